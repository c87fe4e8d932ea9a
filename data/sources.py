"""Where prepare.py's documents come from: local files, or a Hugging Face dataset.

A source yields document texts in one fixed order and can start at any document index: an
interrupted run resumes at the index its last checkpoint recorded. `identity()` describes the
input for the progress manifest, so a rerun on different input is refused instead of mixed in.
"""
import itertools
import json
import os

from errors import UserError

OPENWEBTEXT = "Skylion007/openwebtext"  # the hub also redirects the historical name "openwebtext" here
FILE_TYPES = (".txt", ".jsonl", ".parquet")
READ_BATCH = 1000  # documents read per Arrow slice or parquet batch


# ----------------------------------------------------------------------------------------
# Local files: .txt (one document per file), .jsonl (one per non-blank line), .parquet (one per row)


class FileDocuments:
    def __init__(self, paths, text_column):
        self.paths, self.text_column = paths, text_column
        for path in paths:
            check_file(path, text_column)
        counts = [cheap_document_count(p) for p in paths]
        self.total = None if None in counts else sum(counts)  # .jsonl needs a pass to count

    def identity(self):
        files = [[os.path.abspath(p), os.path.getsize(p), os.stat(p).st_mtime_ns] for p in self.paths]
        return {"files": files, "text_column": self.text_column}

    def describe(self):
        return f"{len(self.paths)} local file(s)"

    def documents(self, start=0):
        """Texts from document index `start` on; whole files before it are skipped unread when possible."""
        to_skip = start
        for path in self.paths:
            if to_skip:
                count = cheap_document_count(path)
                count = count if count is not None else count_jsonl_documents(path)
                if count <= to_skip:
                    to_skip -= count
                    continue
            yield from itertools.islice(read_file(path, self.text_column), to_skip, None)
            to_skip = 0


def check_file(path, text_column):
    if not os.path.isfile(path):
        raise UserError(f"no such file: {path}")
    if not path.endswith(FILE_TYPES):
        raise UserError(f"{path}: unsupported file type (use {', '.join(FILE_TYPES)})")
    if path.endswith(".parquet"):
        parquet_file(path, text_column)


def cheap_document_count(path):
    """Documents in a file when knowable without reading its text, else None."""
    if path.endswith(".txt"):
        return 1
    if path.endswith(".parquet"):
        return parquet_file(path, None).metadata.num_rows
    return None


def read_file(path, text_column):
    if path.endswith(".txt"):
        return read_txt(path)
    if path.endswith(".jsonl"):
        return read_jsonl(path, text_column)
    return read_parquet(path, text_column)


def read_txt(path):
    with open(path, "rb") as f:
        yield decode_utf8(f.read(), path)


def decode_utf8(raw, where):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{where}: not UTF-8 text (byte {err.start}); convert it first, "
                        "e.g. iconv -f latin1 -t utf-8") from None


def is_document_line(raw_line):
    return bool(raw_line.strip())


def read_jsonl(path, text_column):
    # Lines are split on b"\n" both here and in count_jsonl_documents, so both count alike.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not is_document_line(raw):
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(decode_utf8(raw, where))
            except json.JSONDecodeError as err:
                raise UserError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(record, dict) or text_column not in record:
                raise UserError(f"{where}: not a JSON object with a {text_column!r} field "
                                "(choose the field with --text-column)")
            yield require_text(record[text_column], where)


def count_jsonl_documents(path):
    with open(path, "rb") as f:
        return sum(1 for raw in f if is_document_line(raw))


def parquet_file(path, text_column):
    """An open pyarrow ParquetFile, checked to hold a string column `text_column` (unless None)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise UserError(f"{path}: not a readable parquet file ({err})") from None
    if text_column is not None:
        schema = parquet.schema_arrow
        if text_column not in schema.names:
            raise UserError(f"{path}: no column {text_column!r} (columns: {', '.join(schema.names)}); "
                            "choose one with --text-column")
        column_type = schema.field(text_column).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise UserError(f"{path}: column {text_column!r} holds {column_type}, not text")
    return parquet


def read_parquet(path, text_column):
    row = 0
    for batch in parquet_file(path, text_column).iter_batches(batch_size=READ_BATCH, columns=[text_column]):
        for text in batch.column(0).to_pylist():
            yield require_text(text, f"{path}: row {row}")
            row += 1


def require_text(value, where):
    if not isinstance(value, str):
        raise UserError(f"{where}: the text is {type(value).__name__}, not a string")
    return value


# ----------------------------------------------------------------------------------------
# Hugging Face datasets: a hub name (OpenWebText by default) or a local dataset folder


class HubDocuments:
    def __init__(self, name, config, split, revision, text_column, num_proc):
        self.name, self.config, self.split, self.revision = name, config, split, revision
        self.text_column = text_column
        dataset = load_hub_dataset(name, config, split, revision, num_proc)
        if text_column not in dataset.column_names:
            raise UserError(f"dataset {name!r} has no column {text_column!r} (columns: "
                            f"{', '.join(dataset.column_names)}); choose one with --text-column")
        self.dataset = dataset.select_columns([text_column])
        self.total = len(dataset)

    def identity(self):
        return {"dataset": self.name, "config": self.config, "split": self.split,
                "revision": self.revision, "text_column": self.text_column, "documents": self.total}

    def describe(self):
        config = f", config {self.config}" if self.config else ""
        return f"dataset {self.name} (split {self.split}{config})"

    def documents(self, start=0):
        # The Arrow table is memory-mapped: slicing reads only the rows asked for.
        for first in range(start, self.total, READ_BATCH):
            texts = self.dataset[first:first + READ_BATCH][self.text_column]
            for offset, text in enumerate(texts):
                yield require_text(text, f"dataset {self.name!r} row {first + offset}")


def load_hub_dataset(name, config, split, revision, num_proc):
    """datasets.load_dataset, with the ways it fails on a user's input turned into UserError."""
    import datasets  # imported here: it is slow to import and only this source needs it
    try:
        return datasets.load_dataset(name, config, split=split, revision=revision,
                                     num_proc=num_proc if num_proc > 1 else None)
    except RuntimeError as err:
        if "scripts are no longer supported" not in str(err):
            raise
        raise UserError(f"cannot load dataset {name!r}: {err}. datasets>=4 cannot run loading scripts; "
                        "pass --revision with a script-free revision of the repository, or download its "
                        "data files and use --files") from None
    except (ConnectionError, FileNotFoundError, ValueError, datasets.exceptions.DatasetsError) as err:
        offline = " (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE is set)" if datasets.config.HF_HUB_OFFLINE else ""
        raise UserError(f"cannot load dataset {name!r}{offline}: {err}") from None


def open_source(args):
    """The document source the command line asks for."""
    if args.files:
        return FileDocuments(args.files, args.text_column)
    return HubDocuments(args.dataset or OPENWEBTEXT, args.dataset_config, args.dataset_split,
                        args.revision, args.text_column, args.num_proc)
