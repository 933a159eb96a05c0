"""ggml's devices as dgemma sees them: the registry's list, and RPC servers added to it (docs/engine.md#devices).

`DGEMMA_RPC=host:port,...` names ggml RPC servers (llama.cpp's `rpc-server`, or `python -m dgemma_engine.rpc_server`);
`Model.load` adds them before placing the weights, and their devices count as accelerators for `num_gpu`.
RPC is unauthenticated and unencrypted: use it on loopback or a private network only.
"""
from __future__ import annotations

import ctypes
import functools
import ipaddress
import os
import socket
from dataclasses import dataclass

from dgemma_engine._lib import load_library
from dgemma_engine.errors import EngineError

RPC_ENV = "DGEMMA_RPC"  # registered in dgemma_cli.env's table (read here, by the engine)
_CONNECT_TIMEOUT_S = 5.0
_ERR_LEN = 1024


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    kind: str  # "cpu", "gpu" (what layers are placed on: GPUs and RPC devices) or "accel"
    free: int
    total: int


@functools.cache
def _engine() -> ctypes.CDLL:
    lib = load_library("engine")
    C, S = ctypes.c_char_p, ctypes.c_size_t
    for name, restype, argtypes in (("dg_rpc_available", ctypes.c_int, []),
                                    ("dg_rpc_add_server", ctypes.c_int, [C, C, S]),
                                    ("dg_rpc_start_server", ctypes.c_int, [C, ctypes.c_int, C, S]),
                                    ("dg_devices_describe", ctypes.c_int, [C, S])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def serve_rpc(endpoint: str, threads: int) -> str:
    """Serve this process's CPU as a ggml RPC device; blocks while the server runs, returns why it could not start."""
    err = ctypes.create_string_buffer(_ERR_LEN)
    _engine().dg_rpc_start_server(endpoint.encode(), threads, err, _ERR_LEN)
    return err.value.decode("utf-8", "replace")


def list_devices() -> list[Device]:
    buf = ctypes.create_string_buffer(16384)
    _engine().dg_devices_describe(buf, len(buf))
    out = []
    for line in buf.value.decode("utf-8", "replace").splitlines():
        name, description, kind, free, total = line.split("\t")
        out.append(Device(name, description, kind, int(free), int(total)))
    return out


def rpc_available() -> bool:
    """Whether ggml here has its RPC backend (llama-cpp-python built with CMAKE_ARGS="-DGGML_RPC=on")."""
    return bool(_engine().dg_rpc_available())


def parse_endpoints(text: str) -> list[str]:
    """`host:port,host:port` -> the endpoints, checked (ggml aborts the process on one it cannot parse)."""
    endpoints = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise EngineError(f"invalid RPC server {item!r}: expected host:port")
        endpoints.append(item)
    return endpoints


def add_rpc_server(endpoint: str) -> None:
    """Add the devices of the RPC server at `endpoint`. Checks that it accepts connections first: ggml's RPC client
    aborts the whole process when a server cannot be reached."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise EngineError(f"cannot reach the RPC server at {endpoint}: {exc.strerror or exc}") from None
    err = ctypes.create_string_buffer(_ERR_LEN)
    if _engine().dg_rpc_add_server(endpoint.encode(), err, _ERR_LEN) != 0:
        raise EngineError(err.value.decode("utf-8", "replace"))


@functools.cache
def _added(endpoints: tuple[str, ...]) -> None:
    for endpoint in endpoints:
        add_rpc_server(endpoint)


def add_rpc_servers_from_env() -> None:
    """The servers of DGEMMA_RPC, added once per process (ggml's registry only grows)."""
    text = os.environ.get(RPC_ENV, "")
    if text.strip():
        _added(tuple(parse_endpoints(text)))


def is_loopback_or_private(endpoint: str) -> bool:
    """Whether the server's host is a loopback or private address (the only places RPC belongs)."""
    host = endpoint.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private
