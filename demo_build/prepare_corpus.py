"""`python -m demo_build.prepare_corpus --faq-deb FILE`: write the larger demo corpus, demo_build/corpus/large/.

The large demo model (configs/demo-large.json, `python -m demo_build --preset tpu`) learns from the small corpus
(demo_build/corpus/*) plus what this writes, once, from text available offline:

- debian_faq.txt: the prose of the Debian GNU/Linux FAQ (Debian package `debian-faq`, its plain-text edition
  /usr/share/doc/debian/FAQ/debian-faq.en.txt.gz), one paragraph a line, URLs in parentheses dropped;
- project_docs.txt: the prose of this repository's README.md and docs/*.md (no code, tables or headings);
- faq_dialogues.jsonl: each FAQ question whose heading ends in "?" asked as a chat, answered with the first
  sentences of its answer (at most ANSWER_WORDS words), so the model learns to answer briefly and stop;
- json_dialogues.jsonl and json_facts.txt: the same facts, and the small corpus's one-question dialogues, as
  short JSON objects ({"answer": ...}, and
  {"question": ..., "answer": ...} as plain lines), with strings closed after a few words, so that a
  json_object or json_schema request closes its strings well within 64 tokens.

The output is committed (the trainer reads only the committed files); rerunning this on the same package and
docs rewrites the same bytes. LICENSES.md beside the output names each source and its licence.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT_DIR = pathlib.Path(__file__).resolve().parent / "corpus" / "large"
SMALL_DIALOGUES = pathlib.Path(__file__).resolve().parent / "corpus" / "dialogues.jsonl"
FAQ_MEMBER = "usr/share/doc/debian/FAQ/debian-faq.en.txt.gz"
ANSWER_WORDS = 40  # a chat answer: its first sentences up to this many words
JSON_WORDS = 24  # a JSON answer's string: its first sentence, cut at a comma to fit this many words
JSON_PROMPTS = ("Reply in JSON.", "Answer as a JSON object.", "Give the answer as JSON with the key answer.")
HEADING = re.compile(r"^(\d+(?:\.\d+)+)\.\s+(.*)$")
URL_IN_PARENS = re.compile(r"\s*\(\s*https?://[^)]*\)")


def faq_text(deb: pathlib.Path) -> str:
    """The FAQ's plain text out of the .deb (dpkg-deb unpacks the data member)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True)
        return gzip.decompress((pathlib.Path(tmp) / FAQ_MEMBER).read_bytes()).decode("utf-8")


def faq_sections(text: str) -> Iterator[tuple[str, list[str]]]:
    """(heading, prose paragraphs) for every numbered section after the table of contents. Body paragraphs
    are indented by exactly four spaces; deeper indents (lists, commands, examples) are left out."""
    lines = text.replace("\u00a0", " ").splitlines()  # the FAQ's non-breaking spaces, as plain ones
    body_start = max(i for i, line in enumerate(lines) if line.startswith("1.1. "))  # the last one: past the contents
    heading, paragraphs, current, in_heading = "", [], [], False
    for line in lines[body_start:] + [""]:
        match = HEADING.match(line)
        if match:
            if heading:
                yield heading, paragraphs
            heading, paragraphs, current, in_heading = match.group(2).strip(), [], [], True
        elif in_heading and line and not line.startswith(" "):
            heading += " " + line.strip()
        elif not line.strip():
            in_heading = False
            if current:
                paragraphs.append(URL_IN_PARENS.sub("", " ".join(current)).replace(" .", "."))
            current = []
        elif line.startswith("    ") and not line.startswith("     "):
            current.append(line.strip())
    if heading:
        yield heading, paragraphs


def first_sentences(paragraph: str, words: int) -> str:
    """Whole sentences from the start while they fit in `words` words (at least the first, cut at `words`)."""
    sentences = re.split(r"(?<=[.!?])\s+", paragraph.strip())
    kept: list[str] = []
    for sentence in sentences:
        if kept and len(" ".join([*kept, sentence]).split()) > words:
            break
        kept.append(sentence)
    text = " ".join(kept)
    if len(text.split()) > words:
        text = " ".join(text.split()[:words]).rstrip(",;:") + "."
    return text


def short_answer(answer: str) -> str:
    """The first sentence; a longer one is cut after its last comma within JSON_WORDS words (or at the limit)."""
    sentence = re.split(r"(?<=[.!?])\s+", answer.strip())[0]
    words = sentence.split()
    if len(words) <= JSON_WORDS:
        return sentence
    head = " ".join(words[:JSON_WORDS])
    cut = head.rfind(",")
    return (head[:cut] if cut > len(head) // 2 else head.rstrip(",;:")) + "."


def markdown_prose(text: str) -> Iterator[str]:
    """Paragraphs of a Markdown file that read as prose: no fenced code, tables, headings or HTML; list items
    become paragraphs; links keep their text; emphasis and code marks dropped."""
    fenced, current = False, []
    for line in text.splitlines() + [""]:
        if line.startswith("```"):
            fenced = not fenced
            continue
        stripped = line.strip()
        skip = fenced or stripped.startswith(("|", "#", "<", ">", "    "))
        starts_item = re.match(r"^\s*([-*]|\d+\.)\s+", line)
        if (not stripped or skip or starts_item) and current:
            yield _clean_markdown(" ".join(current))
            current = []
        if stripped and not skip:
            current.append(re.sub(r"^\s*([-*]|\d+\.)\s+", "", stripped))


def _clean_markdown(text: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[`*]", "", text).strip()


def prose_ok(paragraph: str) -> bool:
    """Sentences of several words that end like a sentence: what a reader would call prose."""
    return len(paragraph.split()) >= 8 and paragraph.endswith((".", "?", "!", ":")) and "://" not in paragraph


def project_questions(path: pathlib.Path) -> list[tuple[str, str]]:
    """(question, answer) of the small corpus's one-question conversations without a system message."""
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        messages = json.loads(line)["messages"] if line.strip() else []
        if [m["role"] for m in messages] == ["user", "assistant"] and len(messages[1]["content"].split()) > 6:
            pairs.append((messages[0]["content"], messages[1]["content"]))
    return pairs


def chat(question: str, answer: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": question},
                                    {"role": "assistant", "content": answer}]}, ensure_ascii=False)


def write_corpus(faq: str, docs: Sequence[pathlib.Path], out: pathlib.Path) -> dict[str, int]:
    sections = list(faq_sections(faq))
    faq_paragraphs = [p for _, paragraphs in sections for p in paragraphs if prose_ok(p)]
    doc_paragraphs = [p for path in docs for p in markdown_prose(path.read_text(encoding="utf-8")) if prose_ok(p)]
    questions = [(q, first_sentences(ps[0], ANSWER_WORDS)) for q, ps in sections if q.endswith("?") and ps
                 and prose_ok(ps[0])]
    dialogues = [chat(q, a) for q, a in questions]
    json_answers = [(q, short_answer(a)) for q, a in [*questions, *project_questions(SMALL_DIALOGUES)]]
    json_dialogues = [chat(f"{q} {JSON_PROMPTS[i % len(JSON_PROMPTS)]}", json.dumps({"answer": a}, ensure_ascii=False))
                      for i, (q, a) in enumerate(json_answers)]
    facts = [json.dumps({"question": q, "answer": a}, ensure_ascii=False) for q, a in json_answers]
    out.mkdir(parents=True, exist_ok=True)
    files = {"debian_faq.txt": faq_paragraphs, "project_docs.txt": doc_paragraphs, "json_facts.txt": facts,
             "faq_dialogues.jsonl": dialogues, "json_dialogues.jsonl": json_dialogues}
    for name, lines in files.items():
        (out / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return {name: len(lines) for name, lines in files.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo_build.prepare_corpus", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--faq-deb", type=pathlib.Path, required=True,
                        help="the debian-faq package file (apt-get download debian-faq)")
    parser.add_argument("--out", type=pathlib.Path, default=OUT_DIR, help="folder to write")
    args = parser.parse_args(argv)
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    counts = write_corpus(faq_text(args.faq_deb), docs, args.out)
    print(json.dumps({"out": str(args.out), "lines": counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
