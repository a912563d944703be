"""The learning-rate schedules equal the Hugging Face Trainer's (transformers.get_scheduler) at every step."""

from __future__ import annotations

import pytest
import torch

from nbtrain.engine.schedules import make_scheduler


def _lrs(make, steps):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out, sched


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup,total", [(0, 10), (3, 10), (10, 10), (0, 1), (4, 37)])
def test_schedules_equal_the_trainers(name, warmup, total):
    from transformers.optimization import get_scheduler

    hf_name = "constant_with_warmup" if name == "constant" and warmup else name
    ours, _ = _lrs(lambda o: make_scheduler(name, o, warmup, total), total + 2)
    theirs, _ = _lrs(lambda o: get_scheduler(hf_name, o, num_warmup_steps=warmup, num_training_steps=total),
                     total + 2)
    assert ours == theirs   # exactly: the same arithmetic


def test_a_checkpointed_schedule_resumes_where_it_was():
    lrs, sched = _lrs(lambda o: make_scheduler("cosine", o, 2, 10), 4)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    again = make_scheduler("cosine", opt, 2, 10)
    again.load_state_dict(sched.state_dict())
    assert again.last_epoch == sched.last_epoch == 4
    assert again.get_last_lr() == sched.get_last_lr()


def test_an_unknown_schedule_is_named():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="scheduler: must be one of constant, linear, cosine, got 'step'"):
        make_scheduler("step", opt, 0, 10)
