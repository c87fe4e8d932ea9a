"""Cut plain-text files into documents of about --chars characters at paragraph breaks, as
JSONL for `data/prepare.py --files` (a handful of books would otherwise be a handful of
documents, too few for a train/val split by documents).

    python -m data.split_text ../shared/corpus/*.txt --out data/books.jsonl
    python -m data.split_text alice29.txt asyoulik.txt plrabn12.txt --chars 1500 --max-chars 3000 \
        --out data/sample/books.jsonl      # the bundled sample (data/sample/README.md)
"""
import argparse
import json
import re


def pieces(paragraph, max_chars):
    """The paragraph, or (longer than max_chars) runs of its lines of at most about max_chars:
    verse such as Paradise Lost has few blank lines, and one 50k-character document would
    decide a small validation split alone."""
    if not max_chars or len(paragraph) <= max_chars:
        yield paragraph
        return
    run = []
    for line in paragraph.split("\n"):
        run.append(line)
        if sum(len(l) + 1 for l in run) >= max_chars:
            yield "\n".join(run)
            run = []
    if run:
        yield "\n".join(run)


def documents(text, chars, max_chars=None):
    doc = []
    for paragraph in (p for whole in re.split(r"\n\s*\n", text) for p in pieces(whole, max_chars)):
        doc.append(paragraph)
        if sum(len(p) for p in doc) >= chars:
            yield "\n\n".join(doc)
            doc = []
    if doc:
        yield "\n\n".join(doc)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="plain-text files")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--chars", type=int, default=3000, help="least characters per document")
    p.add_argument("--max-chars", type=int, default=None,
                   help="cut paragraphs longer than this at line breaks first (default: never)")
    args = p.parse_args()
    count = 0
    with open(args.out, "w") as out:
        for path in sorted(args.files):
            with open(path, encoding="utf-8", errors="replace") as f:
                for doc in documents(f.read(), args.chars, args.max_chars):
                    out.write(json.dumps({"text": doc}) + "\n")
                    count += 1
    print(f"wrote {count} documents to {args.out}")


if __name__ == "__main__":
    main()
