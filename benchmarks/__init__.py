"""Benchmark and profiling tools, run as modules from the repository root
(`python -m benchmarks.bench_train --out=$OUT`), beside the records they write
(`benchmarks/NAME.json` and `NAME.md`). scripts/ holds the user's entry points."""
