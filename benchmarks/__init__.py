"""Benchmarks of the serving stack, measured the way clients and other serving stacks measure.

`python -m benchmarks` drives the public gateway with many concurrent gRPC streams and reports
vLLM's serving metrics; the modules beside it measure what each layer costs (`layers`), the decode
step against the machine's memory bandwidth (`roofline`, `step`), the tokenizer service
(`tokenizer`), and cross-check the load generator with k6 and AIPerf on one stack (`crosscheck`; `stackcheck` compares the benchmark's stack with the launcher's). `suite` runs what
docs/benchmarks.md reports. Each is its own command (`python -m benchmarks.<module>`); the
reliability experiments (`chaos`, `attack`) live here too, as separate commands.

`measured/` holds every result the docs cite (the suite's JSON and plots, the decode-step and profile runs
of docs/performance.md, the last attack run); the tools' default output folder, `measured/local/`, is
ignored by git, so a local run never overwrites a committed result unless asked to (`make bench-docs`).
"""
