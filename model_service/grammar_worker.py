"""A constraint compile worker (grammar_pool.py starts it): `python -m model_service.grammar_worker TOKENIZER OPTIONS`.

Loads the tokenizer's vocabulary, says {"ready": true}, then answers one JSON line per request line on
stdin: the constraint's checked grammar ({"grammar": ...}) or why it cannot be served ({"error": "field: ..."}),
as structured.checked_grammar decides. It exits when stdin closes. Whatever the library does to this process
(a crash, a compile that never ends) costs only this process: the service kills and replaces it.
"""

from __future__ import annotations

import json
import resource
import sys
import traceback
from typing import Any

from model_service.constraint import Bounds, Constraint, ConstraintKind
from model_service.structured import ConstraintError, Vocabulary, checked_grammar

MEMORY_BYTES = 4 << 30  # the worker's address space: its vocabulary, the library and one compile


def answer(vocabulary: Vocabulary, request: dict[str, Any], limits: dict[str, Any], bounds: Bounds) -> dict[str, Any]:
    c = Constraint(ConstraintKind(request["kind"]), request.get("text", ""), tuple(request.get("choices", ())))
    try:
        return {"grammar": checked_grammar(vocabulary, c, limits, bounds)}
    except ConstraintError as e:
        return {"error": str(e)}
    except Exception:  # noqa: BLE001 - anything else the library raises is still this constraint's problem
        traceback.print_exc(file=sys.stderr)
        return {"error": f"{c.field}: the grammar library could not compile it; simplify the constraint"}


def main(argv: list[str]) -> int:
    # A compile that would take all the machine's memory fails here (MemoryError: refused) rather than
    # pushing the service's own process out of memory.
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    tokenizer, options = argv[0], json.loads(argv[1])
    limits, bounds = options["limits"], Bounds(**options["bounds"])
    vocabulary = Vocabulary(tokenizer)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin.buffer:  # UTF-8 JSON lines whatever the locale; answers are ASCII JSON
        out.write(json.dumps(answer(vocabulary, json.loads(line), limits, bounds)) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
