"""The run's objective: the next-token loss (``objective="lm"``) or a preference loss (DPO, ORPO, SimPO).

The loop asks its objective for each micro-batch's ``(loss sum, stats)``; it divides the loss by the step's
``loss_units`` (target tokens, or pairs) and adds the stats up on the device, read at the step's one sync. The LM
objective has no stats, so the loop is the same for both.

A preference micro-batch (``collate`` of examples with ``rejected_input_ids``) holds the P pairs' chosen sequences
in rows 0..P-1 and their rejected ones in rows P..2P-1: one forward for both. A sequence's log-prob is the sum of its
answer tokens' log-probs (the labels that are not -100), computed in fp32 from the head's logits at those positions
only (the prompt's and the padding's logits are never made). Per pair, with c/r the chosen/rejected log-probs:

- DPO (sigmoid): ``-log σ(β((c - c_ref) - (r - r_ref)))``; rewards ``β(c - c_ref)``, ``β(r - r_ref)``. The
  reference is the same model with its adapters off (LoRA, QLoRA: no copy), a frozen copy of the model in the
  weights' dtype (full fine-tune), or log-probs computed once before training (``precompute_ref``).
- ORPO: ``-c̄ + λ·(-log σ(log odds(c̄) - log odds(r̄)))`` with c̄, r̄ the mean log-prob per answer token and
  ``log odds(p) = p - log(1 - e^p)``; rewards ``λ c̄``, ``λ r̄`` (LLaMA-Factory's).
- SimPO: ``-log σ(β(c̄ - r̄) - γ)``; rewards ``β c̄``, ``β r̄``.

The stats of a micro-batch are sums over its pairs: (chosen reward, rejected reward, pairs ranked right), so a
step's means over all its pairs are the same whatever the micro-batch split (8 x 1 = 2 x 4 = 1 x 8). A pair with a
non-finite reward makes the step's sum non-finite (and its accuracy NaN): never averaged away.
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..precision import autocast
from .telemetry import sampled_step
from .losses import ChunkedLossError, decoder_inputs, micro_loss_sum, split_for_chunked_loss, target_positions

STATS = ("reward_chosen", "reward_rejected", "reward_accuracy")


def _measured(step: int, total: int) -> bool:
    # the log-prob mismatch's sampled steps (an extra fp32 forward each)
    return sampled_step(step, total)


def data_steps(st, start_step: int):
    """The data's steps (``data.iter_steps``): every rank walks the same global order in global micro-batches of
    micro x world rows and takes its share, so N processes x micro m see exactly the examples of 1 process x micro
    N*m."""
    from ..data import iter_steps

    cfg = st.cfg
    return iter_steps(st.data.train, cfg.micro_batch_size * st.dist.world, cfg.grad_accum_steps,
                      cfg.data_order_seed, st.data.pad_token_id, st.data.task, start_step=start_step)


class LMObjective:
    """The next-token loss over the step's target tokens (``losses.micro_loss_sum``); no stats."""

    name = "lm"
    n_stats = 0

    def __init__(self, st):
        self.st = st

    def batches(self, start_step: int):
        """``(epoch, micro-batches)`` of each step from ``start_step`` on (``data_steps``)."""
        return data_steps(self.st, start_step)

    def begin_step(self, step: int) -> None:
        pass

    def micro_loss(self, model, mb):
        """(sum of the micro-batch's per-target losses in fp32, an empty stats tensor)."""
        st = self.st
        loss = micro_loss_sum(model, mb, st.data.task, st.spec, st.device, st.chunk_tokens, st.loss_parts,
                              st.cfg.compile)
        return loss, loss.new_zeros(0)

    def record_fields(self, stats: list[float], n_pairs: int, step: int) -> dict:
        return {}

    def summary(self) -> dict:
        return {}


def sequence_logps(model, mb, spec, device: str, parts=None, keep_tokens: bool = False):
    """(per-row sum of answer-token log-probs (2P,) fp32, per-row answer-token counts (2P,), the per-token log-probs
    (flat, in target order) when ``keep_tokens``) of a preference micro-batch, the forward under ``spec``'s autocast.

    ``parts``: the model's (decoder, head) split, so the head runs on the answer positions only; without it the
    model's own logits are gathered."""
    labels = mb.labels
    rows, width = labels.shape
    with autocast(spec, device):
        if parts is not None:
            decoder, head = parts
            hidden = decoder(**decoder_inputs(mb.input_ids, mb.attention_mask, mb.position_ids)).last_hidden_state
            idx, ys = target_positions(labels, mb.n_targets)
            logits = head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, idx))
        else:
            logits = model(**mb.forward_inputs()).logits
            idx, ys = target_positions(labels, mb.n_targets)
            logits = logits.reshape(-1, logits.shape[-1]).index_select(0, idx)
    token_logps = -F.cross_entropy(logits.float(), ys, reduction="none")
    row_of = torch.div(idx, width, rounding_mode="floor")
    sums = torch.zeros(rows, device=token_logps.device, dtype=torch.float32).index_add_(0, row_of, token_logps)
    counts = (labels[:, 1:] != -100).sum(1).to(torch.float32)
    return sums, counts, (token_logps.detach() if keep_tokens else None)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, accurate near 0 and far below it."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_losses(objective: str, beta: float, gamma: float, sums: torch.Tensor, counts: torch.Tensor,
                ref_sums: Optional[torch.Tensor] = None):
    """(per-pair losses (P,), chosen rewards (P,), rejected rewards (P,)) in fp32 from the rows' log-prob sums
    (chosen rows first) and answer-token counts; ``ref_sums`` the reference's sums (DPO)."""
    p = sums.shape[0] // 2
    c, r = sums[:p], sums[p:]
    if objective == "dpo":
        rc, rr = ref_sums[:p], ref_sums[p:]
        chosen, rejected = beta * (c - rc), beta * (r - rr)
        return -F.logsigmoid(chosen - rejected), chosen.detach(), rejected.detach()
    mc, mr = c / counts[:p].clamp(min=1), r / counts[p:].clamp(min=1)
    if objective == "simpo":
        return -F.logsigmoid(beta * (mc - mr) - gamma), (beta * mc).detach(), (beta * mr).detach()
    if objective == "orpo":
        log_odds = (mc - mr) - (_log1mexp(mc) - _log1mexp(mr))
        return -mc - beta * F.logsigmoid(log_odds), (beta * mc).detach(), (beta * mr).detach()
    raise ValueError(f"objective: {objective!r} is not a preference objective; allowed: dpo, orpo, simpo")


def _pair_stats(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(chosen) & torch.isfinite(rejected)
    right = torch.where(finite, (chosen > rejected).float(), torch.full_like(chosen, float("nan")))
    return torch.stack([chosen.sum(), rejected.sum(), right.sum()])


class PreferenceObjective:
    """DPO, ORPO or SimPO on preference micro-batches (see the module docstring)."""

    n_stats = len(STATS)

    def __init__(self, st):
        self.st = st
        cfg = st.cfg
        self.name, self.beta, self.gamma = cfg.objective, float(cfg.pref_beta), float(cfg.simpo_gamma)
        self.parts = None
        if st.dist.world == 1 and not st.dist.sharded:
            # the head on the answer positions only; under DDP the forward must go through the wrapper
            try:
                self.parts = split_for_chunked_loss(st.model)
            except ChunkedLossError:
                pass
        self.ref_model = None      # the frozen copy (full-fine-tune DPO)
        self.ref_table = None      # precomputed reference log-probs, (examples, 2), on the device
        self.eval_table = None     # the same for the held-out pairs
        self.ref_kind = None
        self._measure = False
        self._mismatch = torch.zeros(2, device=st.device, dtype=torch.float64)   # (sum |Δ log p|, tokens)
        self._mismatch_steps = 0
        self._named_nonfinite = False
        if self.name == "dpo":
            self._set_reference()

    def batches(self, start_step: int):
        """``(epoch, micro-batches)`` of each step from ``start_step`` on (``data_steps``)."""
        return data_steps(self.st, start_step)

    # -- the reference (DPO) ---------------------------------------------------------------------------------
    def _set_reference(self) -> None:
        st = self.st
        if hasattr(st.model, "disable_adapter") and st.cfg.method in ("lora", "qlora"):
            self.ref_kind = "adapters off"
            st.notes.append("DPO reference: the same model with its LoRA adapters disabled (no copy)")
        elif st.cfg.precompute_ref:
            self.ref_kind = "precomputed"
            self.ref_table = self._precompute(st.data.train)
            self.eval_table = self._precompute(st.data.eval) if st.data.eval else None
            st.host_tensors.also_holds([t for t in (self.ref_table, self.eval_table) if t is not None])
            n = len(st.data.train) + len(st.data.eval or [])
            st.notes.append(f"DPO reference: log-probs of the {n} pairs computed once before step 1 "
                            "(precompute_ref=True; no copy of the model)")
        else:
            self.ref_kind = "frozen copy"
            self.ref_model = copy.deepcopy(st.model).requires_grad_(False)
            self.ref_model.eval()
            st.host_tensors.also_holds([*self.ref_model.parameters(), *self.ref_model.buffers()])
            dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in self.ref_model.parameters()})
            st.notes.append(f"DPO reference: a frozen copy of the initial model ({'/'.join(dtypes)} weights, no "
                            "gradients or optimizer state)")

    def _ref_parts(self, model):
        if model is self.st.model:
            return self.parts
        try:
            return split_for_chunked_loss(model)
        except ChunkedLossError:
            return None

    @torch.no_grad()
    def _precompute(self, examples: list[dict]) -> torch.Tensor:
        from ..data import collate

        st = self.st
        table = torch.empty(len(examples), 2, device=st.device, dtype=torch.float32)
        was = st.model.training
        st.model.eval()
        try:
            b = st.cfg.micro_batch_size
            for s in range(0, len(examples), b):
                idx = tuple(range(s, min(s + b, len(examples))))
                mb = collate([examples[i] for i in idx], st.data.pad_token_id, st.data.task, indices=idx)
                sums, _, _ = sequence_logps(st.model, mb.to(st.device), st.spec, st.device, self.parts)
                p = len(idx)
                table[s:s + p, 0], table[s:s + p, 1] = sums[:p], sums[p:]
        finally:
            st.model.train(was)
        return table

    @torch.no_grad()
    def _reference_sums(self, mb) -> torch.Tensor:
        st = self.st
        if self.ref_table is not None:
            return self._lookup(self.ref_table, mb)
        if self.ref_model is not None:
            return sequence_logps(self.ref_model, mb, st.spec, st.device, self._ref_parts(self.ref_model))[0]
        with st.model.disable_adapter():
            return sequence_logps(st.model, mb, st.spec, st.device, self.parts)[0]

    # -- the step -------------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self._measure = _measured(step, self.st.total_steps)
        self._first = True

    def micro_loss(self, model, mb):
        """(sum of the micro-batch's per-pair losses in fp32, sums of its pairs' rewards and right rankings)."""
        st = self.st
        measure, self._first = self._measure and self._first, False
        if measure:   # before this step's update: the weights the step's forward used
            self._measure_mismatch(mb)
        sums, counts, _ = sequence_logps(model, mb, st.spec, st.device, self.parts)
        ref = self._reference_sums(mb) if self.name == "dpo" else None
        losses, chosen, rejected = pair_losses(self.name, self.beta, self.gamma, sums, counts, ref)
        return losses.sum(), _pair_stats(chosen, rejected)

    @torch.no_grad()
    def _measure_mismatch(self, mb) -> None:
        """|log p_run - log p_fp32| over the answer tokens of this micro-batch: two forwards without dropout (eval
        mode: a dropout mask is noise, not the dtype, and drawing one would shift the run's random stream), in the
        run's precision and in fp32 on the same weights (16-bit weights are lifted to fp32 for it and put back
        exactly); added up on the device, read at the end."""
        from ..precision import PRECISION_TABLE

        st = self.st
        model = st.model
        low = [p for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32]
        if st.spec == PRECISION_TABLE["fp32"] and not low:
            # The run computes in fp32 on fp32 weights: the fp32 forward would repeat the run's exactly, so the
            # mismatch is 0 by definition; counting its answer tokens spares the two forwards (a quarter of a step).
            n = (mb.labels[:, 1:] != -100).sum().to(torch.float64)
            self._mismatch += torch.stack([torch.zeros_like(n), n])
            self._mismatch_steps += 1
            return
        dtypes = [p.dtype for p in low]
        was = model.training
        model.eval()
        try:
            run_tokens = sequence_logps(model, mb, st.spec, st.device, self.parts, keep_tokens=True)[2]
            for p in low:   # bf16 -> fp32 -> bf16 is exact, so the run's weights come back bit for bit
                p.data = p.data.float()
            ref_tokens = sequence_logps(model, mb, PRECISION_TABLE["fp32"], st.device, self.parts,
                                        keep_tokens=True)[2]
        finally:
            for p, dt in zip(low, dtypes):
                p.data = p.data.to(dt)
            model.train(was)
        self._mismatch += torch.stack([(run_tokens - ref_tokens).abs().sum().double(),
                                       torch.tensor(float(run_tokens.numel()), device=run_tokens.device,
                                                    dtype=torch.float64)])
        self._mismatch_steps += 1

    def record_fields(self, stats: list[float], n_pairs: int, step: int) -> dict:
        """The StepRecord's reward fields from the step's summed stats over its ``n_pairs`` pairs; the first step
        with a non-finite reward is named in the run's notes."""
        if not self._named_nonfinite and not all(math.isfinite(v) for v in stats[:2]):
            self._named_nonfinite = True
            self.st.notes.append(f"step {step}: a preference reward was not finite (sums over the step's pairs: "
                                 f"chosen {stats[0]}, rejected {stats[1]}); the step counts as non-finite")
        n = max(1, n_pairs)
        chosen, rejected, right = (v / n for v in stats)
        return {"reward_chosen": chosen, "reward_rejected": rejected, "reward_margin": chosen - rejected,
                "reward_accuracy": right}

    def summary(self) -> dict:
        """``logprob_mismatch`` (one read of the device totals, at the end) and how the reference was held."""
        total, n = self._mismatch.tolist()
        return {"objective": self.name, "logprob_mismatch": total / n if n else None,
                "logprob_mismatch_steps": self._mismatch_steps, "reference": self.ref_kind}

    @torch.no_grad()
    def evaluate(self, model, examples: list[dict]) -> dict:
        """The held-out pairs' mean preference loss (``eval_loss``, per pair), their count (``eval_tokens``) and the
        share ranked right by the implicit reward (``eval_accuracy``); no mismatch is measured."""
        from ..data import iter_steps

        st = self.st
        if not examples:
            return {}
        table = self._eval_table(examples) if self.ref_table is not None else None
        was = model.training
        model.eval()
        total = torch.zeros((), device=st.device, dtype=torch.float64)
        right = torch.zeros((), device=st.device, dtype=torch.float64)
        b = st.cfg.micro_batch_size
        it = iter_steps(examples, b, 1, 0, st.data.pad_token_id, st.data.task)
        try:
            for _ in range(math.ceil(len(examples) / b)):
                _, (mb,) = next(it)
                mb = mb.to(st.device)
                sums, counts, _ = sequence_logps(model, mb, st.spec, st.device, self.parts)
                ref = None
                if self.name == "dpo":
                    ref = self._lookup(table, mb) if table is not None else self._reference_sums(mb)
                losses, chosen, rejected = pair_losses(self.name, self.beta, self.gamma, sums, counts, ref)
                total += losses.sum().double()
                right += _pair_stats(chosen, rejected)[2].double()
        finally:
            model.train(was)
        n = len(examples)
        loss, acc = total.item() / n, right.item() / n
        return {"eval_loss": loss, "eval_tokens": n, "eval_accuracy": acc}

    def _eval_table(self, examples: list[dict]) -> torch.Tensor:
        # the held-out pairs' reference log-probs, computed once on the first evaluation: the model has trained
        # by then, so a precomputed reference needs them from before step 1 (prepare asks for them there)
        if self.eval_table is None:
            raise RuntimeError("precompute_ref: the held-out pairs' reference log-probs were not computed")
        return self.eval_table

    @staticmethod
    def _lookup(table: torch.Tensor, mb) -> torch.Tensor:
        ix = torch.tensor(mb.indices, device=table.device, dtype=torch.long)
        return torch.cat([table[ix, 0], table[ix, 1]])


def make_objective(st):
    """The run's objective object for ``st.cfg.objective``."""
    if st.cfg.objective == "lm":
        return LMObjective(st)
    if st.cfg.objective == "grpo":
        from .grpo_run import GrpoObjective

        return GrpoObjective(st)
    return PreferenceObjective(st)


__all__ = ["LMObjective", "PreferenceObjective", "STATS", "make_objective", "pair_losses", "sequence_logps"]
