"""A step whose gradient norm is not finite is not applied, decided on the device (no host sync).

One NaN or inf anywhere in the gradients makes the global norm non-finite; torch's
clip_grad_norm_ then multiplies every gradient by max_norm / NaN (or by 0 for an inf norm) and
every optimizer applies the result: the whole model NaN, or a step with zero gradients that
still moves the weights through the momentum. Instead (`clip_or_mark`), a non-finite norm makes
EVERY gradient NaN (the clip coefficient is NaN), and each optimizer leaves what a NaN gradient
reaches as it was:
- ManifoldMuon leaves a matrix whose gradient has a non-finite entry as it was: weight,
  momentum and warm start (its own mask per matrix, on the device; manifolds/optimizer.py).
  Under --fsdp its sharded step has no such mask (a rank sees only its shard of a gradient), and
  the trainer reads the flag on the host and does not call it: one host sync a step more, before
  the Muon step (the loss is read after it in any case); AdamW is gated on the device as below.
- torch's AdamW (`adamw_step`): fused, its own found_inf (as GradScaler uses it) skips the update
  in the kernel and takes the step count back; otherwise the parameters and their state are kept
  beside the step and chosen back with torch.where (a copy of AdamW's parameters and state for
  the step: the non-fused path is the CPU's, where the trainer builds AdamW unfused).
- QK-Clip (`forget_logits`): the forward's logit maxima of a skipped step are dropped (-inf),
  so it scales nothing (an inf logit would otherwise scale q and k to zero).
For a finite norm the clip is torch's own (the same two functions clip_grad_norm_ calls, the same
bits). The host reads the flag with the step's loss, after the step (train_gpt2.train_step), to
count the skips and stop after --max-skipped-steps in a row.
"""
import torch

from manifolds.sharded import local


def clip_or_mark(parameters, max_norm):
    """(the gradients' global 2-norm, a 0-dim bool on the device: whether it is finite). Clips
    the gradients to `max_norm` as clip_grad_norm_ does where the norm is finite; where it is not,
    makes every gradient NaN, so that each optimizer leaves its parameters as they were."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm
    parameters = [p for p in parameters if p.grad is not None]
    total = get_total_norm([p.grad for p in parameters], 2.0, error_if_nonfinite=False)
    finite = total.isfinite()
    # NaN: max_norm / NaN is NaN, and clamp keeps it; an inf norm would give 0 (a zero-gradient step)
    clip_grads_with_norm_(parameters, max_norm, torch.where(finite, total, float("nan")))
    return total, finite


def adamw_step(adamw, finite):
    """adamw.step(), applied only where `finite` (a 0-dim bool on the device) is true: otherwise
    its parameters and state (moments, step count) stay as they were, bit for bit (module docstring)."""
    finite = local(finite)
    if all(group.get("fused") for group in adamw.param_groups):
        adamw.found_inf = (~finite).float()  # read by torch's fused AdamW step (Adam.step)
        try:
            adamw.step()
        finally:
            del adamw.found_inf
        return
    stepped = [p for group in adamw.param_groups for p in group["params"] if p.grad is not None]
    before = {}
    for p in stepped:
        before[id(p)] = {"param": local(p.detach()).clone(),
                         **{key: local(value).clone() for key, value in adamw.state.get(p, {}).items()
                            if isinstance(value, torch.Tensor)}}
    adamw.step()
    for p in stepped:
        old = before[id(p)]
        tensors = {"param": p.detach(), **{key: value for key, value in adamw.state[p].items()
                                           if isinstance(value, torch.Tensor)}}
        for key, tensor in tensors.items():
            tensor = local(tensor)
            # state the step created (the first step): its initial value, zeros (moments, step 0)
            kept = old[key] if key in old else torch.zeros_like(tensor)
            tensor.copy_(torch.where(on(finite, tensor.device), tensor, kept))


def forget_logits(qk_clip, finite):
    """QK-Clip's logit maxima of this step dropped where it is skipped (module docstring)."""
    for attention in qk_clip.attentions:
        attention.logit_max.masked_fill_(~on(finite, attention.logit_max.device), -float("inf"))


def on(flag, device):
    """`flag` on `device`: moved only where it is elsewhere (a step count kept on the host)."""
    return flag if flag.device == device else flag.to(device, non_blocking=True)
