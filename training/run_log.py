"""What a run writes as it goes: metrics.jsonl rows (and wandb), and the JSON files beside them.

metrics.jsonl holds one JSON object a line, each with the `step` it belongs to (train rows,
eval rows and events such as auto switches). A resumed run first drops the rows past the
checkpoint it resumes from, so every step appears once however often a run was interrupted.
config.json and summary.json are written atomically (a temporary file and a rename).
"""
import json
import os

from errors import UserError, write_error
from training.checkpoints import write_text_atomic


class RunLog:
    """metrics.jsonl rows and (optionally) wandb."""

    def __init__(self, out_dir, args, resume_step=None):
        self.path = path = os.path.join(out_dir, "metrics.jsonl")
        try:
            if resume_step is not None:
                keep_rows_until(path, resume_step)
            self.metrics = open(path, "a")
        except OSError as err:
            raise write_error(path, err) from None
        self.wandb = None
        if args.wandb != "off":
            import wandb  # imported only when asked for
            try:
                self.wandb = wandb.init(project=args.wandb_project, mode=args.wandb, dir=out_dir,
                                        name=args.run_name or os.path.basename(os.path.abspath(out_dir)),
                                        config={k: v for k, v in vars(args).items() if k != "assignment"})
            except Exception as err:  # no network, a bad key, a server error: wandb's exception types vary
                raise UserError(f"--wandb {args.wandb}: wandb could not start a run ({type(err).__name__}: "
                                f"{str(err)[:300]}); use --wandb offline on a machine without network "
                                "(`wandb sync` uploads later) or --wandb off") from None

    def row(self, **fields):
        try:
            self.metrics.write(json.dumps(fields) + "\n")
            self.metrics.flush()
        except OSError as err:
            raise write_error(self.path, err) from None
        if self.wandb is not None:
            self.wandb.log(flat_metrics({k: v for k, v in fields.items() if k != "step"}), step=fields["step"])

    def close(self):
        try:
            self.metrics.close()
        except OSError as err:
            raise write_error(self.path, err) from None
        if self.wandb is not None:
            self.wandb.finish()


def flat_metrics(fields, prefix=""):
    """Nested row fields as wandb's flat scalar keys: {"sigma_max": {"w": 1.0}, "attn_logit_max":
    [3.0]} -> {"sigma_max/w": 1.0, "attn_logit_max/0": 3.0}."""
    flat = {}
    for key, value in fields.items():
        if isinstance(value, (list, tuple)):
            value = dict(enumerate(value))
        if isinstance(value, dict):
            flat.update(flat_metrics({str(k): v for k, v in value.items()}, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def keep_rows_until(path, step):
    """Drop metrics rows past `step` (written after the checkpoint we resume from)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(f"{path}.tmp", "w") as f:
        f.writelines(rows)
    os.replace(f"{path}.tmp", path)


def write_json(path, obj):
    try:
        write_text_atomic(path, json.dumps(obj, indent=2) + "\n")
    except OSError as err:
        raise write_error(path, err) from None
