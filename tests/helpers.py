"""Test helpers shared by several test files."""

import math


class Collect:
    """A callback that keeps everything it is given."""

    def __init__(self):
        self.info = None
        self.records = []
        self.evals = []
        self.result = None

    def on_run_start(self, info):
        self.info = info

    def on_step_end(self, rec):
        self.records.append(rec)

    def on_eval(self, rec):
        self.evals.append(rec)

    def on_run_end(self, result):
        self.result = result


def after_build(monkeypatch, modify):
    """Patch the engine's build_model so ``modify(model)`` runs on every model a run builds."""
    import nbtrain.engine.prepare as prepare

    original = prepare.build_model

    def build(*args, **kwargs):
        model = original(*args, **kwargs)
        modify(model)
        return model

    monkeypatch.setattr(prepare, "build_model", build)


def inject_inf(monkeypatch, on_forward_calls):
    """Make the model's logits inf on the given (1-based) forward calls of training."""
    calls = {"n": 0}

    def hook(module, inputs, output):
        if not module.training:
            return output
        calls["n"] += 1
        if calls["n"] in on_forward_calls:
            output.logits = output.logits * math.inf
        return output

    after_build(monkeypatch, lambda model: model.register_forward_hook(hook))
    return calls


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tied weight counts once)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total
