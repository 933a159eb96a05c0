"""Serve this machine's CPU as a ggml RPC device: `python -m dgemma_engine.rpc_server 127.0.0.1:50052 [--threads N]`.

The same server as llama.cpp's `rpc-server` binary, started from the ggml libraries llama-cpp-python installed (it
needs an RPC build: CMAKE_ARGS="-DGGML_RPC=on", docs/engine.md#rpc). It runs until it is killed.
RPC is unauthenticated: anyone who can connect can read and write this process's memory buffers and run graphs.
Bind it to loopback or a private network only.
"""
from __future__ import annotations

import argparse
import ctypes
import sys

from dgemma_engine.devices import is_loopback_or_private, parse_endpoints

_ERR_LEN = 1024


def serve(endpoint: str, threads: int) -> str:
    """Blocks while the server runs; returns the error when it cannot start."""
    from dgemma_engine._lib import load_library

    lib = load_library("engine")
    lib.dg_rpc_start_server.restype = ctypes.c_int
    lib.dg_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    err = ctypes.create_string_buffer(_ERR_LEN)
    lib.dg_rpc_start_server(endpoint.encode(), threads, err, _ERR_LEN)
    return err.value.decode("utf-8", "replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgemma_engine.rpc_server", description=__doc__.splitlines()[0])
    parser.add_argument("endpoint", help="host:port to listen on (loopback or a private address)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of the served device")
    args = parser.parse_args(argv)
    endpoints = parse_endpoints(args.endpoint)
    if len(endpoints) != 1:
        parser.error("one host:port")
    if not is_loopback_or_private(endpoints[0]):
        print(f"WARNING: {endpoints[0]} is not a loopback or private address; ggml RPC is unauthenticated",
              file=sys.stderr)
    print(f"Error: {serve(endpoints[0], args.threads)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
