"""`--assign auto`: start every block from a base assignment and move a block's attention to
Stiefel once its diagnostics show DGram attention's failure (scale growth of W_Q, W_K
-> large logits -> a saturated softmax).

At each evaluation, for every layer not yet switched, any of these triggers a switch:
    attn_logit_max[layer]              > logit_max       (max |q.k| / sqrt(d_head))
    softmax_max_prob[layer]            > saturation      (mean largest attention probability)
    sigma_max(attention of the layer)  > sigma_growth x its value at the first evaluation
A threshold <= 0 is off. The decision is a pure function of the logged diagnostics, made on
rank 0 and broadcast; the switches go into checkpoints, so a resumed run rebuilds the same
assignment and, its trajectory being the same, takes the same later decisions.
"""
import re

SWITCH_TO = "stiefel"
LAYER = re.compile(r"blocks\.(\d+)\.attn\.")


class AutoAssign:
    def __init__(self, n_layer, logit_max, saturation, sigma_growth):
        self.n_layer = n_layer
        self.logit_max, self.saturation, self.sigma_growth = logit_max, saturation, sigma_growth
        self.switches = []        # [{"step", "layer", "reason"}], in the order taken
        self.initial_sigma = {}   # layer -> attention sigma_max at the first evaluation

    @property
    def switched(self):
        return {s["layer"] for s in self.switches}

    def layer_assignment(self, base, layer):
        """The {key: manifold} of one block: the base, or Stiefel attention once switched."""
        if layer not in self.switched:
            return dict(base)
        return {key: SWITCH_TO if key.startswith("attn.") else manifold for key, manifold in base.items()}

    def decide(self, step, fields):
        """New switches [{"step", "layer", "reason"}] from an eval row's diagnostics (not applied)."""
        sigma = {}
        for name, value in fields.get("sigma_max", {}).items():
            match = LAYER.search(name)
            if match:
                layer = int(match.group(1))
                sigma[layer] = max(sigma.get(layer, 0.0), value)
        for layer, value in sigma.items():
            self.initial_sigma.setdefault(layer, value)
        new = []
        for layer in range(self.n_layer):
            if layer in self.switched:
                continue
            reasons = []
            logit = fields.get("attn_logit_max", [None] * self.n_layer)[layer]
            prob = fields.get("softmax_max_prob", [None] * self.n_layer)[layer]
            if self.logit_max > 0 and logit is not None and not logit <= self.logit_max:
                reasons.append(f"attention logit max {logit:.3g} > {self.logit_max:g}")
            if self.saturation > 0 and prob is not None and not prob <= self.saturation:
                reasons.append(f"softmax max probability {prob:.3g} > {self.saturation:g}")
            if self.sigma_growth > 0 and layer in sigma:
                growth = sigma[layer] / max(self.initial_sigma[layer], 1e-30)
                if not growth <= self.sigma_growth:
                    reasons.append(f"attention sigma max grew {growth:.3g}x > {self.sigma_growth:g}x")
            if reasons:
                new.append({"step": step, "layer": layer, "reason": "; ".join(reasons)})
        return new

    def apply(self, switches):
        self.switches.extend(switches)

    def state_dict(self):
        return {"switches": [dict(s) for s in self.switches],
                "initial_sigma": {str(k): v for k, v in self.initial_sigma.items()}}

    def load_state_dict(self, state):
        self.switches = [dict(s) for s in state["switches"]]
        self.initial_sigma = {int(k): v for k, v in state["initial_sigma"].items()}
