"""`python -m tests.engine.spec_engines`: the demo model served by a plain engine and by a speculative one (two
compiled programs, as a service started without and with --speculative-config), the speculative one with
drafting off and on, greedy and seeded requests with top_logprobs 2 that quote their prompts. Prints one JSON
line: how many tokens, and how many ids, probabilities and alternatives differ from the plain engine's, under
the instruction-set path GROK_KERNEL_ISA names (the caller sets it: the kernels read it once)."""

from __future__ import annotations

import json
import os

from benchmarks.speculative import quote_prompts
from model_service.loading import build_engine, resolve
from model_service.requests import GenerationRequest
from model_service.sampling_settings import SamplingSettings
from model_service.scheduler import Scheduler
from model_service.speculative import SpeculativeConfig
from tests.engine.conftest import golden_server_config
from tests.engine.test_speculative import serve
from tests.procs import ROOT

SPEC = SpeculativeConfig("ngram", 4, 4, 2)  # the issue's --speculative-config


def main() -> None:
    def engine(spec: SpeculativeConfig | None) -> object:
        config = golden_server_config(config=str(ROOT / "demo" / "config.json"),
                                      checkpoint=str(ROOT / "demo" / "checkpoint"), slots=4, speculative=spec)
        return build_engine(config, resolve(config))

    plain, speculative = engine(None), engine(SPEC)
    sampled = SamplingSettings(temperature=0.8, top_p=0.95, top_logprobs=2)
    requests = [GenerationRequest(f"q{i}", tuple(p), SamplingSettings(top_logprobs=2) if i % 2 else sampled,
                                  seed=40 + i, max_tokens=n, ignore_eos=True)
                for i, (p, n) in enumerate(quote_prompts(4))]
    tokens = {}
    for name, eng, spec in (("plain", plain, None), ("drafting-off", speculative, None),
                            ("drafting-on", speculative, SPEC)):
        scheduler = Scheduler(eng, 8, speculative=spec)  # type: ignore[arg-type]
        scheduler.start()
        try:
            tokens[name] = [t for r in requests for out in serve(scheduler, [r]) for o in out.values()
                            for t in o.tokens]
        finally:
            scheduler.stop()
    base = tokens["plain"]
    report: dict[str, object] = {"isa": os.environ.get("GROK_KERNEL_ISA", "auto"), "tokens": len(base)}
    for name in ("drafting-off", "drafting-on"):
        other = tokens[name]
        report[name] = {"length": len(other),
                        "ids": sum(a[0] != b[0] for a, b in zip(base, other)),
                        "probabilities": sum(a[1] != b[1] for a, b in zip(base, other)),
                        "alternatives": sum(a[2] != b[2] for a, b in zip(base, other)),
                        "largest_relative": max((abs(a[1] - b[1]) / max(abs(a[1]), 1e-30)
                                                 for a, b in zip(base, other)), default=0.0)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
