"""`python -m model_service.run`: one offline completion, like the reference's run.py.

Loads the weights exactly as the service does (loading.py), tokenizes the prompt with SentencePiece (no BOS, as
the reference), generates through the same Engine and Scheduler the service uses (so sampling, seeds and stop
rules are identical), and prints only the completion text on stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

from model_service.config import ConfigError, MeshConfig
from serving_common import logs
from serving_common.flags import EnvArgumentParser, positive_int


def parser() -> EnvArgumentParser:
    p = EnvArgumentParser(env_prefix="GROK_RUN", prog="python -m model_service.run",
                          description="Generate one completion offline and print it on stdout.")
    p.add_env_argument("--config", required=True, help="model preset (grok-1) or JSON config file")
    p.add_env_argument("--checkpoint", default=None, help="directory containing ckpt-0/")
    p.add_env_argument("--random-init", action="store_true", default=False, help="use random weights")
    p.add_env_argument("--tokenizer", required=True, help="SentencePiece model file")
    p.add_env_argument("--prompt", required=True, help="prompt text")
    p.add_env_argument("--max-tokens", type=positive_int, default=100, help="tokens to generate at most")
    p.add_env_argument("--temperature", type=float, default=0.01, help="sampling temperature (0 = greedy)")
    p.add_env_argument("--top-p", type=float, default=1.0, help="nucleus probability mass")
    p.add_env_argument("--seed", type=int, default=42, help="random seed (the reference's default: 42)")
    p.add_env_argument("--ignore-eos", action="store_true", default=False, help="keep going after EOS")
    p.add_env_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_env_argument("--mesh", default="1,1", help="device mesh DATA,MODEL")
    p.add_env_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                       help="log level (stderr)")
    return p


def load(args: argparse.Namespace) -> Any:
    """The one-slot Engine of `args`' model, loaded and compiled as the model service does (loading.py: packed for
    the native products as the weights load, the table kept in the checkpoint's type)."""
    from model_service import loading

    config = loading.ServerConfig(config=args.config, checkpoint=args.checkpoint, random_init=args.random_init,
                                  dtype=args.dtype, mesh=MeshConfig.parse(args.mesh), slots=1, max_queue=1)
    return loading.build_engine(config, loading.resolve(config))


def generate(args: argparse.Namespace) -> str:
    import sentencepiece

    from model_service.requests import Emission, GenerationRequest, SchedulerError
    from model_service.sampling_settings import SamplingSettings
    from model_service.scheduler import Scheduler

    tokenizer = sentencepiece.SentencePieceProcessor(model_file=args.tokenizer)
    ids = tokenizer.encode(args.prompt)
    engine = load(args)
    scheduler = Scheduler(engine, max_queue=1)
    out: list[int] = []
    done = threading.Event()
    failure: list[SchedulerError] = []

    def emit(e: Emission) -> None:
        out.extend(t.id for t in e.tokens)
        if e.error is not None:
            failure.append(e.error)
        if e.error is not None or e.finish_reason is not None:
            done.set()

    scheduler.start()
    try:
        sampling = SamplingSettings(temperature=args.temperature, top_p=args.top_p)
        scheduler.submit(GenerationRequest("run", tuple(ids), sampling, seed=args.seed % 2**32,
                                           max_tokens=args.max_tokens, ignore_eos=args.ignore_eos), emit)
        done.wait()
    finally:
        scheduler.stop()
    if failure:
        raise failure[0]
    return tokenizer.decode(out)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.configure("model-run", args.log_level)
    from model_service.__main__ import prepare_process

    try:
        prepare_process()
    except ConfigError as e:
        print(f"model_service.run: {e}", file=sys.stderr)
        return 2
    from model_service.requests import SchedulerError

    try:
        text = generate(args)
    except (ConfigError, ValueError, SchedulerError) as e:
        print(f"model_service.run: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
