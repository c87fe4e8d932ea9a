"""Cut plain-text files into documents of about --chars characters at paragraph breaks, as
JSONL for `data/prepare.py --files` (a handful of books would otherwise be a handful of
documents, too few for a train/val split by documents).

    python bench/split_text.py ../shared/corpus/*.txt --out data/books.jsonl
"""
import argparse
import json
import re


def documents(text, chars):
    doc = []
    for paragraph in re.split(r"\n\s*\n", text):
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
    args = p.parse_args()
    count = 0
    with open(args.out, "w") as out:
        for path in sorted(args.files):
            with open(path, encoding="utf-8", errors="replace") as f:
                for doc in documents(f.read(), args.chars):
                    out.write(json.dumps({"text": doc}) + "\n")
                    count += 1
    print(f"wrote {count} documents to {args.out}")


if __name__ == "__main__":
    main()
