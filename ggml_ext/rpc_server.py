"""Serve this machine's CPU as a ggml RPC device: `python -m dgemma_engine.rpc_server 127.0.0.1:50052 [--threads N]`.

The same server as llama.cpp's `rpc-server` binary, started from the ggml libraries llama-cpp-python installed (it
needs an RPC build: CMAKE_ARGS="-DGGML_RPC=on", docs/engine.md#rpc). It runs until it is killed.
RPC is unauthenticated: anyone who can connect can read and write this process's memory buffers and run graphs.
Bind it to loopback or a private network only.
"""
from __future__ import annotations

import argparse
import sys

from dgemma_engine.devices import is_loopback_or_private, parse_endpoints, serve_rpc


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
    print(f"Error: {serve_rpc(endpoints[0], args.threads)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
