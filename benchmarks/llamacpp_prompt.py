"""llama.cpp's time for one long prompt alone; run by benchmarks.long_prompt with the llama.cpp build's interpreter.

    DIR/venv/bin/python benchmarks/llamacpp_prompt.py MODEL.gguf TOKENS CONTEXT   -> one JSON line

The anchor's settings (../shared/bench/llamacpp): 2 threads, no extra (AMX) buffers with NO_EXTRA=1; the prompt (random token
ids, like ours) in batches of 512 in a context of CONTEXT cells, timed around the evaluation alone after a short
warm-up. Standalone: it imports llama_cpp only, not this project.
"""

import json
import os
import random
import sys
import time

import llama_cpp


def main() -> None:
    model, tokens, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if os.environ.get("NO_EXTRA") == "1":  # as the anchor's bench.py: no AMX buffers
        params = llama_cpp.llama_model_default_params
        llama_cpp.llama_cpp.llama_model_default_params = llama_cpp.llama_model_default_params = lambda: _no_extra(
            params())
    llm = llama_cpp.Llama(model_path=model, n_ctx=context, n_threads=2, n_threads_batch=2, n_batch=512,
                          n_ubatch=512, verbose=False)
    rng = random.Random(11)
    prompt = [rng.randrange(300, llm.n_vocab()) for _ in range(tokens)]
    llm.eval(prompt[:64])  # warm-up
    llm.reset()
    load = os.getloadavg()[0]
    start = time.perf_counter()
    llm.eval(prompt)
    seconds = time.perf_counter() - start
    print(json.dumps({"prompt_tokens": tokens, "context": context, "seconds": round(seconds, 3),
                      "tokens_per_s": round(tokens / seconds, 1), "load_avg_1m": round(load, 2)}))


def _no_extra(params: "llama_cpp.llama_model_params") -> "llama_cpp.llama_model_params":
    params.use_extra_bufts = False
    return params


if __name__ == "__main__":
    main()
