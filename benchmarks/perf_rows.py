"""The rows of docs/performance.md's tables, as data: which JSON in benchmarks/measured/ each number comes from.

`benchmarks.render_docs` writes the tables from these rows; tests/benchmarks/test_perf_page.py checks that the page
holds what they render and that each row's `make` command runs the module with the settings its JSON records.
A row names one JSON file (the newest measurement of that point), the paths of its numbers inside that file, the
target it is held to, what bounds it, and the make target (with variables) that measures it again.
To publish a new measurement: copy its JSON into benchmarks/measured/, point the row at it, `make bench-page`.
"""

from __future__ import annotations

from dataclasses import dataclass

Path = tuple[str, ...]


@dataclass(frozen=True)
class Num:
    """A number at `path` in the row's JSON, printed with `digits` decimals, times `scale`, then `unit`."""
    path: Path
    digits: int = 1
    unit: str = ""
    scale: float = 1.0


@dataclass(frozen=True)
class Ratio:
    """`num` over `den` (paths in the row's JSON), printed with two decimals and `suffix`."""
    num: Path
    den: Path
    suffix: str = "x"


@dataclass(frozen=True)
class Row:
    """One line of a table. `ours`, `llamacpp` and `ratio` cells are joined with " / "; `bound` may name numbers
    of the JSON as {dotted.path:digits}."""
    point: str
    source: str  # a file in benchmarks/measured/
    module: str  # the benchmarks module that wrote it
    make: str  # the make command that measures it again
    ours: tuple[Num, ...]
    llamacpp: tuple[Num, ...] = ()
    ratio: tuple[Num | Ratio, ...] = ()
    target: str = ""
    bound: str = ""


@dataclass(frozen=True)
class Change:
    """A setting's measured effect: `before` and `now` are the same point in the JSON's two arms."""
    setting: str
    point: str
    source: str
    module: str
    make: str
    before: tuple[Num, ...]
    now: tuple[Num, ...]


def _engine(point: str, arm: str, mode: str) -> dict[str, Path]:
    """Paths of a benchmarks.engine report's numbers for `point`, `arm` and `mode`."""
    return {"decode": ("points", point, arm, mode, "median_decode_tokens_per_s"),
            "ttft": ("points", point, arm, mode, "median_ttft_p50_s"),
            "ll_decode": ("points", point, "llamacpp", "decode_tokens_per_s"),
            "ll_prompt": ("points", point, "llamacpp", "prompt_s")}


def _decode_row(point: str, source: str, make: str, e: dict[str, Path], target: str, bound: str) -> Row:
    return Row(point, source, "engine", make, (Num(e["decode"], 1, " tok/s"),), (Num(e["ll_decode"], 1, " tok/s"),),
               (Ratio(e["decode"], e["ll_decode"]),), target, bound)


def _ttft_row(point: str, source: str, make: str, e: dict[str, Path], target: str, bound: str,
              batch: bool) -> Row:
    what = " (8 x 32 batch)" if batch else " (its prompt)"
    return Row(point, source, "engine", make, (Num(e["ttft"], 3, " s"),), (Num(e["ll_prompt"], 3, " s" + what),),
               (Ratio(e["ttft"], e["ll_prompt"], "x the time"),), target, bound)


AS_USER = "as-user-medium-session-end-23.json"
ENGINE_MEDIUM = "engine-medium-session-end-23.json"
SLOTS = "engine-medium-whole-prompts.json"
LONG = "long-prompt-session-23.json"
LONG_LLAMACPP = "long-prompt-beside-llamacpp.json"
WIDE = "engine-grok1-width-session-23.json"
WIDE_INT8 = "engine-grok1-width-int8-tiles-2.json"
WIDE_INT8_BURST = "engine-grok1-width-int8-tiles-burst.json"
_M1, _M8 = _engine("slots1_stream1", "now", "sampled"), _engine("slots8_streams8", "now", "sampled")
_W1, _W8 = _engine("slots1_stream1", "now", "greedy"), _engine("slots8_streams8", "now", "greedy")
_S1, _S16 = _engine("slots1_stream1", "now", "sampled"), _engine("slots16_stream1", "now", "sampled")
_G1, _G16 = _engine("slots1_stream1", "now", "greedy"), _engine("slots16_stream1", "now", "greedy")
_MAKE_MEDIUM = "make bench-cpu-medium LLAMACPP=DIR"
_MAKE_ENGINE = "make bench-cpu-medium-engine LLAMACPP=DIR"
_MAKE_WIDE = "make bench-cpu-grok1-width LLAMACPP=DIR"
_MAKE_HUGE = "make bench-cpu-medium BEFORE=DIR LLAMACPP=DIR BENCH_ARGS='--runs 4'"
_MAKE_TABLE = "make bench-cpu-grok1-width BEFORE=DIR LLAMACPP=DIR BENCH_ARGS='--tokens 128'"
_BOUND_BYTES_MEDIUM = ("reads 182.6 MB a token (the exact table 109.1, two experts 67.2, attention 6.3) where "
                       "llama.cpp reads 149.8 MB (Q8_0): 0.82x at equal read rates, before the sampler and the service")
_BOUND_BYTES_WIDE = ("reads 2.60 GB a token (the exact table 1.31, two experts 1.21) where llama.cpp reads 2.23 GB "
                     "(Q8_0): 0.86x at equal read rates")

CPU: tuple[Row, ...] = (
    Row("medium, 1 sampled stream (speed.py, default flags)", AS_USER, "as_user", _MAKE_MEDIUM,
        (Num(("points", "streams1", "now", "aggregate_tok_s"), 1, " tok/s"),),
        (Num(("points", "streams1", "llamacpp", "decode_tok_s"), 1, " tok/s"),),
        (Num(("points", "streams1", "now", "over_llamacpp"), 2, "x"),), ">= 0.8x", _BOUND_BYTES_MEDIUM),
    Row("medium, 8 sampled streams, aggregate (speed.py)", AS_USER, "as_user", _MAKE_MEDIUM,
        (Num(("points", "streams8", "now", "aggregate_tok_s"), 1, " tok/s"),),
        (Num(("points", "streams8", "llamacpp", "decode_tok_s"), 1, " tok/s"),),
        (Num(("points", "streams8", "now", "over_llamacpp"), 2, "x"),), ">= 1.0x",
        "the two cores' arithmetic: each expert meets ~2 of the 8 rows, sampling reads 131,072 logits a row"),
    _ttft_row("medium, one 32-token prompt, first token", ENGINE_MEDIUM, _MAKE_ENGINE, _M1,
              "<= 0.1 s", "one step of the prompt's 32 rows", batch=False),
    _ttft_row("medium, 8 simultaneous 32-token prompts, TTFT p50", ENGINE_MEDIUM, _MAKE_ENGINE,
              _M8, "<= 0.35 s", "256 prompt rows in steps of 64: the median waits for 4-5 prompts' rows", batch=True),
    Row("medium, 1 sampled / greedy stream on a 16-slot service, over the 1-slot rate", SLOTS, "engine",
        "make bench-cpu-medium-slots LLAMACPP=DIR",
        (Num(_S16["decode"], 1, " tok/s"), Num(_G16["decode"], 1, " tok/s")), (),
        (Ratio(_S16["decode"], _S1["decode"]), Ratio(_G16["decode"], _G1["decode"])), ">= 0.9x",
        "a free slot computes nothing; what is left is the host's work per slot"),
    Row("medium, 7 streams while a 6,000-token prompt is computed: p99 inter-token gap / median gap without the prompt",
        LONG, "long_prompt", "make bench-cpu-long-prompt",
        (Num(("now", "gap_p99_during_s"), 1, " ms", 1e3), Num(("now", "control_gap_median_s"), 1, " ms", 1e3)), (),
        (Num(("now", "p99_over_control_median"), 2, "x"),), "<= 2x",
        "a step with prompt rows costs ~1.5x a decode step at the fewest rows, and the box's own p99 gap is "
        "{now.control_p99_over_control_median:2}x its median (no prompt)"),
    Row("medium, a 6,000-token prompt alone (context 8,192), first token", LONG_LLAMACPP, "long_prompt",
        "make bench-cpu-long-prompt LLAMACPP=DIR", (Num(("now", "ttft_alone_s"), 2, " s"),),
        (Num(("llamacpp", "seconds"), 1, " s"),), (Num(("now", "alone_over_llamacpp"), 2, "x the time"),), "",
        "attention: each row of the prompt reads every key before it"),
    _decode_row("Grok-1 width, 1 stream decode", WIDE, _MAKE_WIDE, _W1, ">= 0.9x",
                _BOUND_BYTES_WIDE),
    _decode_row("Grok-1 width, 8 streams decode", WIDE, _MAKE_WIDE, _W8, ">= 0.9x",
                "reading the ~7 experts (4.2 GB) the 8 rows select, once a step"),
    _ttft_row("Grok-1 width, one 32-token prompt, first token", WIDE, _MAKE_WIDE, _W1, "<= 1.25x",
              "84.5 GFLOP in exact float32: >= 0.361 s at the two cores' fused multiply-add peak (234 GFLOP/s); "
              "llama.cpp multiplies int8-rounded activations", batch=False),
    _ttft_row("Grok-1 width, 8 simultaneous 32-token prompts, TTFT p50", WIDE, _MAKE_WIDE, _W8,
              "<= 1.5x", "676 GFLOP at the float32 peak, and the median waits for 4-5 prompts' products: >= 1.63 s",
              batch=True),
    Row("Grok-1 width, peak RSS / RSS at SERVING (8-slot service), seconds to SERVING", WIDE, "engine",
        _MAKE_WIDE,
        (Num(("points", "slots8_streams8", "now", "peak_rss_gb"), 2, " GB"),
         Num(("points", "slots8_streams8", "now", "rss_at_serving_gb"), 2, " GB"),
         Num(("points", "slots8_streams8", "now", "start_seconds"), 1, " s")), (),
        (Ratio(("points", "slots8_streams8", "now", "peak_rss_gb"),
               ("points", "slots8_streams8", "now", "rss_at_serving_gb")),), "<= 1.25x",
        "the weights themselves: nothing is held twice at load"),
    _ttft_row("Grok-1 width, `--products native-int8` (opt-in, changes results): one prompt, first token", WIDE_INT8,
              "make bench-cpu-grok1-width-int8 LLAMACPP=DIR", _W1, "<= 1.25x",
              "reading the 4.8 GB of int8 experts a 32-token prompt selects (all 8) at 33-39 GB/s: 123-145 ms",
              batch=False),
    _ttft_row("Grok-1 width, `--products native-int8`: 8 simultaneous prompts, TTFT p50", WIDE_INT8_BURST,
              "make bench-cpu-grok1-width-int8-burst LLAMACPP=DIR", _W8, "<= 1.5x",
              "the int8 products' rate: 361 G multiply-adds a second at 64 rows, VNNI's peak ~466 G on two cores",
              batch=True),
)


# The chip (no TCP sockets there, so no served benchmark yet): benchmarks.step's engine step in process, bfloat16,
# greedy, one JSON per invocation (`make bench-tpu`, run there through ../shared/device/on-device.sh).
DEVICE = "device-tpu-v5e.json"  # benchmarks.device on one v5e chip (several calls merged: --merge)


def _device(point: str, key: str, decode: bool = True) -> Row:
    """A row of benchmarks.device's `table`: the step (and, decoding, the step the serving loop overlaps with the
    next one's planning), against the bound the benchmark computes from the config."""
    ours = ((Num(("table", key, "ms"), 2, " ms a step"), Num(("table", key, "pipelined_ms"), 2, " ms overlapped"),
             Num(("table", key, "tokens_per_s"), 0, " tok/s")) if decode else
            (Num(("table", key, "ms"), 1, " ms"), Num(("table", key, "tokens_per_s"), 0, " tok/s")))
    bound = (f"{{table.{key}.bound_ms:2}} ms: the step's bytes at 819 GB/s or its FLOPs at 197 TFLOP/s, the "
             f"larger; step / bound {{table.{key}.over_bound:2}}x")
    return Row(point, DEVICE, "device", "make bench-tpu", ours, bound=bound)


TPU: tuple[Row, ...] = (
    _device("medium, 1 stream", "medium_bfloat16_decode_1"),
    _device("medium, 8 streams", "medium_bfloat16_decode_8"),
    _device("medium, 64 streams", "medium_bfloat16_decode_64"),
    _device("medium, 8 x 32-token prompts in one step", "medium_bfloat16_prompts_8x32", decode=False),
    _device("medium, one 2,048-token prompt", "medium_bfloat16_long_2048", decode=False),
    _device("Grok-1 width (1 layer), 1 stream", "grok1_1layer_bfloat16_decode_1"),
    _device("Grok-1 width (1 layer), 8 streams", "grok1_1layer_bfloat16_decode_8"),
    _device("Grok-1 width (1 layer), 64 streams", "grok1_1layer_bfloat16_decode_64"),
    _device("Grok-1 width (1 layer), 8 x 32-token prompts in one step", "grok1_1layer_bfloat16_prompts_8x32",
            decode=False),
    _device("Grok-1 width (1 layer), one 2,048-token prompt", "grok1_1layer_bfloat16_long_2048", decode=False),
)


def _arms(point: str, key: str, digits: int, unit: str) -> tuple[tuple[Num, ...], tuple[Num, ...]]:
    return ((Num(("points", point, "before", key), digits, unit),), (Num(("points", point, "now", key), digits, unit),))


CHANGES: tuple[Change, ...] = (
    Change("threads sized to a cgroup CPU limit (`--threads N` sets them): before, two threads under a 1-CPU limit",
           "medium, speed.py, 1 stream", "as-user-medium-cpu-limit-1.json", "as_user",
           "make bench-cpu-limit CGROUP=DIR BEFORE=DIR", *_arms("streams1", "aggregate_tok_s", 1, " tok/s")),
    Change("the same", "medium, speed.py, 8 streams", "as-user-medium-cpu-limit-1.json", "as_user",
           "make bench-cpu-limit CGROUP=DIR BEFORE=DIR", *_arms("streams8", "aggregate_tok_s", 1, " tok/s")),
    Change("huge pages for the weights and buffers (`--huge-pages off` leaves them)", "medium, speed.py, 1 stream",
           "as-user-medium-huge-pages-quiet.json", "as_user", _MAKE_HUGE,
           *_arms("streams1", "aggregate_tok_s", 1, " tok/s")),
    Change("the same", "medium, speed.py, 8 streams", "as-user-medium-huge-pages-quiet.json", "as_user",
           _MAKE_HUGE, *_arms("streams8", "aggregate_tok_s", 1, " tok/s")),
    Change("the table in 13 bits a value (`GROK_KERNEL_TABLE_BITS=16` keeps bfloat16)", "Grok-1 width, 1 stream",
           "engine-grok1-width-table-13-quiet.json", "engine",
           _MAKE_TABLE,
           (Num(_engine("slots1_stream1", "before", "greedy")["decode"], 2, " tok/s"),),
           (Num(_W1["decode"], 2, " tok/s"),)),
    Change("the same", "Grok-1 width, 8 streams", "engine-grok1-width-table-13-quiet.json", "engine",
           _MAKE_TABLE,
           (Num(_engine("slots8_streams8", "before", "greedy")["decode"], 2, " tok/s"),),
           (Num(_W8["decode"], 2, " tok/s"),)),
    Change("speculative decoding, 8 n-gram drafts (`--speculative-config`): before off, now on",
           "demo model, prompts that hold their answer, all tokens", "speculative-continue-copying-demo.json",
           "speculative", "make bench-cpu-speculative", (Num(("continue", "all_tokens_per_s_off"), 1, " tok/s"),),
           (Num(("continue", "all_tokens_per_s_on"), 1, " tok/s"),)),
    Change("the same", "medium, random prompts (nothing to look up)", "speculative-continue-copying-demo.json",
           "speculative", "make bench-cpu-speculative", (Num(("medium", "all_tokens_per_s_off"), 1, " tok/s"),),
           (Num(("medium", "all_tokens_per_s_on"), 1, " tok/s"),)),
)

# The --products fidelity table (benchmarks.render_docs.error_table reads this report's own layout).
ERRORS = Row("--products fidelity", "activation-error.json", "activation_error", "make bench-cpu-activation-error", ())
