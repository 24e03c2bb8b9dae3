"""Ceilings on sizes the `kvpp` command and the deployment spec accept, so that a typo cannot make a command
allocate per-rank tables for a trillion ranks or bind port 99999. Generous, not tuning advice."""

MAX_PARALLEL = 1024
"""Largest parallel size (TP, PP, PCP, DCP, DP); real deployments stay far below."""
MAX_LAYERS = 4096
MAX_SECONDS = 7 * 24 * 3600.0
MAX_IN_FLIGHT = 1 << 16
"""Most completions a `kvpp proxy` may be told to serve at once (each costs two sockets)."""
