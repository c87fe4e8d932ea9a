"""Measure data/prepare.py: tokens/s per worker count, and peak memory on a corpus bigger than a shard.

    python -m bench.prepare_throughput --books /work/shared/corpus/*.txt --tokens 30e6 --num-proc 1 2
    python -m bench.prepare_throughput --books ... --tokens 130e6 --num-proc 2 --shard-tokens 100000000

Builds a local .jsonl corpus of about --tokens GPT-2 tokens by cutting the books into
documents of a few KB (OpenWebText averages about 5 KB) and repeating them, then runs
prepare.py on it once per --num-proc value. Reports wall time, tokens/s (from prepare.py's
own final line, which times tokenization and writing, not start-up) and peak memory: the
largest sum of RSS over prepare.py and its workers (sampled from /proc every 20 ms) and the
largest single process (getrusage). Also CPU seconds of the whole process tree, since on a
shared machine wall-clock rates depend on what else runs (the load average is printed).
"""
import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHARS_PER_TOKEN = 4.3  # English prose under GPT-2 BPE, near enough to size the corpus


def book_documents(paths, doc_chars):
    """Each book's paragraphs, grouped into documents of about doc_chars characters."""
    documents = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            paragraphs = re.split(r"\n\s*\n", f.read())
        current = ""
        for paragraph in paragraphs:
            current = f"{current}\n\n{paragraph}" if current else paragraph
            if len(current) >= doc_chars:
                documents.append(current)
                current = ""
        if current:
            documents.append(current)
    return documents


def write_corpus(path, documents, target_chars):
    written, copy = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target_chars:
            for text in documents:
                f.write(json.dumps({"text": f"[copy {copy}] {text}"}) + "\n")
                written += len(text)
            copy += 1
    return written


def process_tree_rss(pid):
    """Sum of VmRSS (bytes) over pid and its descendants."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        stack.extend(children.get(current, []))
        try:
            with open(f"/proc/{current}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
        except (OSError, StopIteration):
            pass
    return total


def run_prepare(corpus, out_dir, num_proc, shard_tokens):
    command = [sys.executable, "-m", "data.prepare", "--files", corpus, "--out-dir", out_dir,
               "--num-proc", str(num_proc), "--shard-tokens", str(shard_tokens)]
    started, cpu_before = time.time(), children_cpu_seconds()
    load_before = os.getloadavg()[0]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    peak_tree = 0
    while process.poll() is None:
        peak_tree = max(peak_tree, process_tree_rss(process.pid))
        time.sleep(0.02)
    wall = time.time() - started
    last_line = process.stdout.read().strip().splitlines()[-1]
    if process.returncode != 0:
        raise SystemExit(f"prepare.py failed: {last_line}")
    rate = float(re.search(r"; ([\d,]+) tokens/s", last_line).group(1).replace(",", ""))
    tokens = int(re.search(r"done: [\d,]+ documents, ([\d,]+) tokens", last_line).group(1).replace(",", ""))
    cpu = children_cpu_seconds() - cpu_before
    return {"num_proc": num_proc, "wall_s": round(wall, 1), "tokens_per_s": rate,
            "tokens_per_cpu_s": round(tokens / cpu), "cpu_s": round(cpu, 1),
            "peak_rss_tree_mb": round(peak_tree / 2**20), "load_average_before": round(load_before, 2),
            "final_line": last_line}


def children_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", nargs="+", required=True, help="UTF-8 text files to build the corpus from")
    p.add_argument("--tokens", type=float, default=30e6, help="approximate corpus size in tokens")
    p.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shard-tokens", type=int, default=10_000_000)
    p.add_argument("--doc-chars", type=int, default=5000)
    p.add_argument("--repeat", type=int, default=1, help="runs per --num-proc; the best is compared")
    p.add_argument("--work-dir", default=None, help="where corpus and shards go (default: a temp dir, removed)")
    args = p.parse_args()
    work = args.work_dir or tempfile.mkdtemp(prefix="prepare_bench_")
    os.makedirs(work, exist_ok=True)
    corpus = os.path.join(work, "corpus.jsonl")
    chars = write_corpus(corpus, book_documents(args.books, args.doc_chars), args.tokens * CHARS_PER_TOKEN)
    print(f"corpus: {corpus}, {chars / 1e6:.0f} M characters, {os.path.getsize(corpus) / 2**20:.0f} MiB; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    best = {}
    for _ in range(args.repeat):
        for num_proc in args.num_proc:  # interleaved, so a burst of load elsewhere hits both alike
            out_dir = os.path.join(work, f"shards_{num_proc}")
            shutil.rmtree(out_dir, ignore_errors=True)
            result = run_prepare(corpus, out_dir, num_proc, args.shard_tokens)
            print(json.dumps(result), flush=True)
            shutil.rmtree(out_dir)
            if result["tokens_per_s"] > best.get(num_proc, {"tokens_per_s": 0})["tokens_per_s"]:
                best[num_proc] = result
    results = [best[n] for n in args.num_proc]
    print(f"peak RSS of the largest single process: "
          f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f} MiB")
    if len(results) > 1:
        base = results[0]["tokens_per_s"]
        print("best tokens/s:", ", ".join(f"--num-proc {r['num_proc']}: {r['tokens_per_s']:,.0f} "
                                           f"({r['tokens_per_s'] / base:.2f}x)" for r in results))
    if not args.work_dir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
