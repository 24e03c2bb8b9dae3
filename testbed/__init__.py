"""Drivers that only the tests and the benchmarks run: offline vLLM engines over scripted workloads, a
stand-in Mooncake prefill worker, P/D server pairs. Not installed and reached by no `kvpp` command; a driver
runs in a process of its own as `python -m testbed.<module>` (testbed.scripts)."""
