"""The request limits both the gateway and the model service enforce, declared once.

The gateway checks them at its boundary (gateway/validation.py) so that a bad request costs no tokenizer or
model call; the model service checks them again (model_service/validation.py, model_service/constraint.py)
because it is also called directly. The gateway's own operator-tunable limits and defaults (prompt bytes,
stop sequences, default max_tokens, and a lower top_logprobs cap) are flags, declared in gateway/config.py.
"""

from __future__ import annotations

# Sampling controls, with vLLM's and OpenAI's ranges.
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty|
LOGIT_BIAS_LIMIT = 100.0  # |bias| of one logit_bias entry
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's limit; the device keeps a [slots, 300] table)
MAX_STOP_TOKEN_IDS = 64
# Alternatives per token the device computes (model_service/sampling.TOP_K): the most top_logprobs and
# prompt_logprobs may ask for (OpenAI's top_logprobs limit, and vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = 20
# Samples of one request (n; OpenAI's limit): beyond the model's slots they wait for slots to free.
MAX_SAMPLES = 128

# Structured output (model_service/constraint.py checks the first four before any compile).
MAX_CONSTRAINT_CHARS = 64 * 1024  # schema / regex / grammar text, or the choices together
MAX_CHOICES = 1024
MAX_GRAMMAR_RULES = 1000  # rule definitions of a grammar (llguidance crashed on a chain of ~3,000)
MAX_CONSTRAINT_DEPTH = 64  # JSON nesting of a schema, nested parentheses of a regex or grammar
CONSTRAINT_COMPILE_SECONDS = 3.0  # one constraint's compile in its worker process, then it is refused

# Prefix-cache isolation: the most characters of a request's cache_salt (vLLM's field).
MAX_CACHE_SALT_CHARS = 1024
