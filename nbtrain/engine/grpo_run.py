"""Online RL (``objective="grpo"``) as the loop's objective: rollouts, rewards, advantages, the clipped loss, and
the sampler/trainer mismatch at every step.

A step's rows are completions: ``micro_batch_size x grad_accum_steps`` of them, ``num_generations`` (G) per prompt,
so a step holds whole groups. Every ``grpo_iterations`` steps a new batch of rollouts is drawn (``batches``):

1. the step's prompts, in the seeded epoch order every objective uses (``data.epoch_order``);
2. G completions of each, sampled with the KV cache under ``sampler_precision``'s autocast, in eval mode, from a
   generator seeded by (seed, rollout batch): a resumed run draws the same completions, and so does every
   precision variant of a comparison until their weights part (``rollout.sample_group``). The sampler records each
   drawn token's log-prob under the distribution it was drawn from (after temperature and top-p);
3. the rewards of each completion (``rewards.score``), their weighted total, and the group-relative advantages over
   the whole step (``grpo.group_advantages``), before it is cut into micro-batches: accumulation never splits a
   group's baseline;
4. on sampled steps (1-3, every 10th, the last), an fp32 teacher-forced pass of the rows, in eval mode, at the
   weights that sampled them (16-bit weights lifted to fp32 for it and put back exactly).

``micro_loss`` scores a micro-batch's completion tokens with the trainer, one teacher-forced forward under the
training precision (train mode: dropout as configured), at the same temperature, and returns the clipped
surrogate's sum (``grpo.grpo_terms``) for the loop to divide by the step's units (completions, completions x
max_new_tokens, or completion tokens: ``grpo_loss``). On the first update of a rollout batch the old log-probs
are these log-probs themselves (the ratio is exactly 1, as TRL's); later updates of the batch reuse them.
``is_correction="token_truncate"`` weighs each token's surrogate by ``min(p_trainer_old / p_sampler, is_cap)``.

The mismatch is the sampler's log-probs against the trainer's first-update log-probs of the same tokens, read once
per rollout batch (each step of the batch reports it); the rewards, lengths and zero-std share likewise. Reading
them costs a few host syncs a step; the sampling loop syncs on every token anyway.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import pandas as pd
import torch
import torch.nn.functional as F

from ..precision import PRECISION_TABLE, autocast
from .grpo import GRPO_LOSSES, Mismatch, group_advantages, grpo_terms, loss_units, mismatch
from .losses import ChunkedLossError, decoder_inputs, split_for_chunked_loss
from .rewards import RewardError, parse_rewards, score
from .rollout import sample_group
from .telemetry import sampled_step

ROLLOUT_FIELDS = ("step", "group", "prompt", "completion", "completion_tokens")   # then each reward, reward, advantage
# each completion token's log-prob under the sampler and under the trainer's first update (float32 tensors, filled
# once that update has run): the mismatch's own numbers, token by token
TOKEN_FIELDS = ("sampler_logp", "trainer_logp")


@dataclass
class GrpoBatch:
    """A micro-batch of completions: rows are prompt + completion, right-padded. ``positions[i, j]`` is the position
    whose logit predicts completion token j of row i; ``mask`` 1 on completion tokens (the stop token counts)."""

    input_ids: torch.Tensor        # (R, L)
    attention_mask: torch.Tensor   # (R, L)
    positions: torch.Tensor        # (R, T)
    completion_ids: torch.Tensor   # (R, T)
    mask: torch.Tensor             # (R, T) float
    sampler_logp: torch.Tensor     # (R, T) float32
    advantages: torch.Tensor       # (R,) float32
    n_targets: int                 # completion tokens
    loss_units: float              # what it adds to the step's divisor under grpo_loss
    n_tokens: int                  # prompt + completion tokens (the update's throughput)
    data_mask: torch.Tensor = None  # (R, L) 1 on the prompt's tokens: what the data gave (fingerprint.chain_step)
    n_pairs: int = 0
    indices: tuple = ()

    _TENSORS = ("input_ids", "attention_mask", "positions", "completion_ids", "mask", "sampler_logp", "advantages",
                "data_mask")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def _map(self, fn) -> "GrpoBatch":
        out = GrpoBatch(**{**self.__dict__})
        for name in self._TENSORS:
            setattr(out, name, fn(getattr(self, name)))
        return out

    def to(self, device, non_blocking: bool = False) -> "GrpoBatch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "GrpoBatch":
        return self._map(lambda t: t.pin_memory())

    def state(self) -> dict:
        """Plain data a checkpoint holds (``torch.load(weights_only=True)`` reads it)."""
        return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}


@dataclass
class _Rollouts:
    """One batch of rollouts: its micro-batches, what the trainer said of them on the first update, and the step
    fields every step of the batch reports."""

    index: int
    micro: list
    old: dict = field(default_factory=dict)          # micro index -> the first update's log-probs (R, T), detached
    fp32: dict = field(default_factory=dict)         # micro index -> an fp32 pass's log-probs (sampled steps)
    fields: dict = field(default_factory=dict)       # reward_mean, reward_std, completion_len_mean, frac_zero_std
    mm: Optional[dict] = None                        # the Mismatch fields, once the first update has run
    gaps: Optional[dict] = None                      # sampler/trainer fp32 gaps, on a sampled batch
    row_start: int = 0                               # its first completion's row in the rollout table


def _sampling_seed(seed: int, batch: int) -> int:
    # a generator per rollout batch: nothing to save for a resume, and the same draws in every variant
    return (seed * 1_000_003 + batch * 7_919 + 12_345) % (2**63 - 1)


class GrpoObjective:
    """The GRPO objective (see the module docstring)."""

    name = "grpo"
    n_stats = 0

    def __init__(self, st):
        from ..data.chat import end_of_turn_ids
        from ..hardware import capabilities, check_runnable
        from .sampling import stop_ids

        self.st = st
        cfg = st.cfg
        if st.dist.world > 1 or st.dist.sharded:
            raise ValueError("objective: 'grpo' runs in one process here (its rollouts are sampled by the one "
                             "model); launch it without torchrun / accelerate launch")
        try:
            self.rewards = parse_rewards(cfg.reward, cfg.reward_weights)
        except RewardError as e:
            raise RewardError(f"{e} (TrainConfig.reward)") from None
        self.G, self.kind = cfg.num_generations, cfg.grpo_loss
        assert self.kind in GRPO_LOSSES
        self.per_step = cfg.micro_batch_size * cfg.grad_accum_steps
        self.prompts_per_step = self.per_step // self.G
        self.sampler_precision = st.precision
        if cfg.sampler_precision not in (None, st.precision):
            self.sampler_precision = check_runnable(cfg.replace(precision=cfg.sampler_precision),
                                                    capabilities(torch.device(st.device).type))
        self.sampler_spec = PRECISION_TABLE[self.sampler_precision]
        self.stops = frozenset(stop_ids(st.tokenizer, st.model) | end_of_turn_ids(st.tokenizer, cfg))
        self.parts = None
        try:
            self.parts = split_for_chunked_loss(st.model)
        except ChunkedLossError:
            pass
        self.ref_model, self.ref_kind = None, None
        if cfg.grpo_beta > 0:
            if hasattr(st.model, "disable_adapter") and cfg.method in ("lora", "qlora"):
                self.ref_kind = "adapters off"
                st.notes.append("GRPO reference (grpo_beta > 0): the same model with its LoRA adapters disabled")
            else:
                import copy

                self.ref_kind = "frozen copy"
                self.ref_model = copy.deepcopy(st.model).requires_grad_(False).eval()
                st.host_tensors.also_holds([*self.ref_model.parameters(), *self.ref_model.buffers()])
                st.notes.append("GRPO reference (grpo_beta > 0): a frozen copy of the initial model")
        if self.sampler_precision != st.precision:
            st.notes.append(f"GRPO: completions sampled in {self.sampler_precision}, trained in {st.precision}")
        if st.data.eval:
            st.notes.append(f"GRPO: the {len(st.data.eval)} held-out prompts are not evaluated (eval_fraction="
                            f"{cfg.eval_fraction}); set eval_fraction=0 to train on them")
        self._orders: dict[int, list[int]] = {}
        self.batch: Optional[_Rollouts] = None
        self._micro_i = 0
        self._dev = torch.zeros(3, device=st.device, dtype=torch.float64)   # clipped tokens, k3 KL sum, tokens
        self.rows: list[dict] = []                 # result.rollouts
        self.rollout_s = 0.0
        self.rollout_tokens = 0
        self._mm_totals = [0.0, 0]                 # the run's sum |delta log p| and tokens

    # -- the steps' rows --------------------------------------------------------------------------------------
    def batches(self, start_step: int):
        """Endless ``(epoch after this step, its micro-batches)``, drawing a rollout batch every
        ``grpo_iterations`` steps (after a resume, the checkpoint's batch when it is not used up)."""
        mu = self.st.cfg.grpo_iterations
        step = start_step
        n = len(self.st.data.train)
        while True:
            step += 1
            b = (step - 1) // mu
            if self.batch is None or self.batch.index != b:
                self.batch = self._rollouts(b, step)
            yield (b + 1) * self.prompts_per_step / n, self.batch.micro

    def _prompt_indices(self, b: int) -> list[int]:
        from ..data import epoch_order

        n = len(self.st.data.train)
        out = []
        for k in range(b * self.prompts_per_step, (b + 1) * self.prompts_per_step):
            epoch, pos = divmod(k, n)
            if epoch not in self._orders:
                self._orders = {epoch: epoch_order(n, self.st.cfg.data_order_seed, epoch)}
            out.append(self._orders[epoch][pos])
        return out

    @torch.no_grad()
    def _rollouts(self, b: int, step: int) -> _Rollouts:
        st, cfg, G = self.st, self.st.cfg, self.G
        examples = [st.data.train[i] for i in self._prompt_indices(b)]
        gen = torch.Generator(device=st.device).manual_seed(_sampling_seed(cfg.seed, b))
        t0 = time.perf_counter()
        groups = [sample_group(st.model, ex["input_ids"], G, cfg.max_new_tokens, temperature=cfg.temperature,
                               top_p=cfg.top_p, stops=self.stops, pad_id=st.data.pad_token_id,
                               spec=self.sampler_spec, generator=gen) for ex in examples]
        lengths = [n for g in groups for n in g.lengths]   # a host read: every sampled token is done
        self.rollout_s += time.perf_counter() - t0
        self.rollout_tokens += sum(lengths)
        completions = [st.tokenizer.decode(g.completion_ids[i, :n].tolist(), skip_special_tokens=True)
                       for g in groups for i, n in zip(range(G), g.lengths)]
        prompts = [ex["prompt"] for ex in examples for _ in range(G)]
        columns: dict[str, list] = {}
        for name in sorted({k for ex in examples for k in ex["columns"]}):
            columns[name] = [ex["columns"].get(name) for ex in examples for _ in range(G)]
        columns["completion_tokens"] = lengths
        each, totals = score(self.rewards, prompts, completions, columns)   # a RewardError names the reward
        rewards = torch.tensor(totals, dtype=torch.float64)
        adv, zero_std = group_advantages(rewards, G)
        micro = self._micro_batches(examples, groups, adv.float())
        row_start = len(self.rows)
        for r, (ex_i, g_i) in enumerate((e, g) for e in range(len(examples)) for g in range(G)):
            row = {"step": step, "group": b * self.prompts_per_step + ex_i, "prompt": _prompt_text(prompts[r]),
                   "completion": completions[r], "completion_tokens": lengths[r]}
            row.update({name: each[name][r] for name in each})
            row.update({"reward": totals[r], "advantage": float(adv[r]), "variant": st.variant})
            self.rows.append(row)
        fields = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(totals) > 1
                  else 0.0, "completion_len_mean": sum(lengths) / len(lengths), "frac_zero_std": zero_std}
        out = _Rollouts(index=b, micro=micro, fields=fields, row_start=row_start)
        if any(sampled_step(s, st.total_steps) for s in range(step, step + cfg.grpo_iterations)):
            out.fp32 = {i: self._fp32_logp(mb.to(st.device)) for i, mb in enumerate(micro)}
        return out

    def _micro_batches(self, examples: list[dict], groups: list, adv: torch.Tensor) -> list[GrpoBatch]:
        st, m = self.st, self.st.cfg.micro_batch_size
        rows = []   # (prompt ids, completion ids, mask, sampler logp) of each completion, group by group
        for ex, g in zip(examples, groups):
            for i in range(self.G):
                rows.append((ex["input_ids"], g.completion_ids[i].cpu(), g.mask[i].cpu(), g.sampler_logp[i].cpu()))
        out = []
        for s in range(0, len(rows), m):
            chunk = rows[s:s + m]
            t = max(int(r[2].sum()) for r in chunk)
            length = max(len(r[0]) + t for r in chunk)
            n_rows = len(chunk)
            ids = torch.full((n_rows, length), st.data.pad_token_id, dtype=torch.long)
            attn = torch.zeros(n_rows, length, dtype=torch.long)
            prompt_mask = torch.zeros(n_rows, length, dtype=torch.long)
            comp = torch.full((n_rows, t), st.data.pad_token_id, dtype=torch.long)
            mask = torch.zeros(n_rows, t)
            slogp = torch.zeros(n_rows, t)
            pos = torch.zeros(n_rows, t, dtype=torch.long)
            for r, (p, c, k, lp) in enumerate(chunk):
                n = int(k.sum())
                ids[r, :len(p)] = torch.tensor(p, dtype=torch.long)
                ids[r, len(p):len(p) + n] = c[:n]
                attn[r, :len(p) + n] = 1
                prompt_mask[r, :len(p)] = 1
                comp[r, :n], mask[r, :n], slogp[r, :n] = c[:n], 1.0, lp[:n].float()
                # the logit at position i predicts token i + 1; padding positions point at the last real one
                pos[r] = (len(p) - 1 + torch.arange(t)).clamp(max=len(p) + max(n, 1) - 2)
            n_targets = int(mask.sum())
            out.append(GrpoBatch(input_ids=ids, attention_mask=attn, positions=pos, completion_ids=comp, mask=mask,
                                 sampler_logp=slogp, advantages=adv[s:s + n_rows].clone(), n_targets=n_targets,
                                 loss_units=loss_units(self.kind, mask, st.cfg.max_new_tokens),
                                 n_tokens=int(attn.sum()), data_mask=prompt_mask,
                                 indices=tuple(range(s, s + n_rows))))
        return out

    # -- log-probs -------------------------------------------------------------------------------------------
    def completion_logp(self, model, mb: GrpoBatch, spec) -> torch.Tensor:
        """The log-probs ``model`` gives each completion token of ``mb`` (R, T) in fp32, one teacher-forced forward
        under ``spec``'s autocast at the run's temperature; 0 on padding. Keeps the graph."""
        st = self.st
        parts = self.parts if model is st.model else None
        with autocast(spec, st.device):
            if parts is not None:
                decoder, head = parts
                hidden = decoder(**decoder_inputs(mb.input_ids, mb.attention_mask)).last_hidden_state
                h = hidden.gather(1, mb.positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
                logits = head(h)
            else:
                logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
                logits = logits.gather(1, mb.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        logp = F.log_softmax(logits.float() / st.cfg.temperature, dim=-1)
        return logp.gather(-1, mb.completion_ids.unsqueeze(-1)).squeeze(-1) * mb.mask

    def _fp32_logp(self, mb: GrpoBatch) -> torch.Tensor:
        model = self.st.model
        low = [p for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32]
        dtypes = [p.dtype for p in low]
        was = model.training
        model.eval()
        try:
            for p in low:   # bf16 -> fp32 -> bf16 is exact: the run's weights come back bit for bit
                p.data = p.data.float()
            return self.completion_logp(model, mb, PRECISION_TABLE["fp32"]).detach()
        finally:
            for p, dt in zip(low, dtypes):
                p.data = p.data.to(dt)
            model.train(was)

    @torch.no_grad()
    def _ref_logp(self, mb: GrpoBatch) -> torch.Tensor:
        st = self.st
        if self.ref_model is not None:
            return self.completion_logp(self.ref_model, mb, st.spec)
        with st.model.disable_adapter():
            return self.completion_logp(st.model, mb, st.spec)

    # -- the loop's calls ------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self._micro_i = 0
        self._dev.zero_()

    def micro_loss(self, model, mb: GrpoBatch):
        """(the micro-batch's clipped-surrogate sum, an empty stats tensor)."""
        cfg, batch = self.st.cfg, self.batch
        i, self._micro_i = self._micro_i, self._micro_i + 1
        logp = self.completion_logp(model, mb, self.st.spec)
        if i not in batch.old:   # the batch's first update: the trainer's own log-probs are the old ones
            batch.old[i] = logp.detach()
        old = batch.old[i]
        ref = self._ref_logp(mb) if cfg.grpo_beta > 0 else None
        weights = None
        if cfg.is_correction == "token_truncate":
            weights = torch.exp(old - mb.sampler_logp).clamp(max=cfg.is_cap) * mb.mask
        terms = grpo_terms(logp, old, mb.advantages, mb.mask, self.kind, cfg.grpo_epsilon, beta=cfg.grpo_beta,
                           ref_logp=ref, token_weights=weights)
        self._dev += torch.stack([terms.clipped_tokens.double(), terms.kl_sum.double(), terms.tokens.double()])
        return terms.loss_sum, logp.new_zeros(0)

    def record_fields(self, stats: list[float], n_pairs: int, step: int) -> dict:
        """The step's GRPO fields: its rollout batch's mismatch, rewards and lengths, and its own clip share."""
        batch = self.batch
        if batch.mm is None:   # the batch's first update has run: its sampler/trainer pairs are complete
            s = torch.cat([mb.sampler_logp.reshape(-1) for mb in batch.micro])
            t = torch.cat([batch.old[i].reshape(-1).cpu() for i in range(len(batch.micro))])
            k = torch.cat([mb.mask.reshape(-1) for mb in batch.micro])
            mm = mismatch(s, t, k)
            batch.mm = asdict(mm)
            self._token_logps(batch)
            n = int(k.sum())
            if math.isfinite(mm.mismatch_mean):
                self._mm_totals[0] += mm.mismatch_mean * n
                self._mm_totals[1] += n
            if batch.fp32:
                f = torch.cat([batch.fp32[i].reshape(-1).cpu() for i in range(len(batch.micro))])
                keep = k.bool()
                batch.gaps = {"sampler_fp32_gap": float((s - f)[keep].abs().double().mean()),
                              "trainer_fp32_gap": float((t - f)[keep].abs().double().mean())}
            first = True
        else:
            first = False
        clipped, _, tokens = self._dev.tolist()
        gaps = batch.gaps if (first and batch.gaps) else {"sampler_fp32_gap": None, "trainer_fp32_gap": None}
        return {**batch.mm, **gaps, **batch.fields, "clip_ratio": clipped / tokens if tokens else 0.0}

    def _token_logps(self, batch: _Rollouts) -> None:
        # micro-batch i holds completions mb.indices of the batch, in the table's order
        for i, mb in enumerate(batch.micro):
            old = batch.old[i].detach().float().cpu()
            for j, r in enumerate(mb.indices):
                n = int(mb.mask[j].sum())
                row = self.rows[batch.row_start + r]
                row["sampler_logp"], row["trainer_logp"] = mb.sampler_logp[j, :n].clone(), old[j, :n].clone()

    def summary(self) -> dict:
        """The run's sampling and update throughputs apart, the token-weighted mismatch, how the reference was held."""
        recs = self.st.records
        step_s = sum(r.step_time_s for r in recs)
        update_tokens = sum(r.tokens_per_s * r.step_time_s for r in recs)
        update_s = step_s - self.rollout_s
        total, n = self._mm_totals
        return {"objective": "grpo", "reference": self.ref_kind,
                "rollout_s": self.rollout_s,
                "rollout_tokens_per_s": self.rollout_tokens / self.rollout_s if self.rollout_s > 0 else None,
                "update_tokens_per_s": update_tokens / update_s if update_s > 0 else None,
                "mismatch_mean": total / n if n else None, "sampler_precision": self.sampler_precision}

    def evaluate(self, model, examples: list[dict]) -> dict:
        return {}

    def rollout_frame(self) -> pd.DataFrame:
        """``result.rollouts``: one row per completion; ``sampler_logp`` and ``trainer_logp`` hold its tokens'
        log-probs (the mismatch's own numbers) once its batch's first update has run."""
        names = [r.name for r in self.rewards]
        cols = [*ROLLOUT_FIELDS, *names, "reward", "advantage", *TOKEN_FIELDS, "variant"]
        return pd.DataFrame(self.rows, columns=cols)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The rollout batch in use (a resume inside it trains on the same completions), the rollout table and
        the timers."""
        b = self.batch
        out: dict[str, Any] = {"rows": self.rows, "rollout_s": self.rollout_s, "rollout_tokens": self.rollout_tokens,
                               "mm_totals": list(self._mm_totals)}
        if b is not None:
            out["batch"] = {"index": b.index, "micro": [mb.state() for mb in b.micro],
                            "old": {str(i): t.cpu() for i, t in b.old.items()}, "fields": b.fields,
                            "mm": b.mm, "gaps": b.gaps, "row_start": b.row_start}
        return out

    def load_state_dict(self, state: Optional[dict]) -> None:
        if not state:
            return
        self.rows = list(state.get("rows", []))
        self.rollout_s, self.rollout_tokens = state.get("rollout_s", 0.0), state.get("rollout_tokens", 0)
        self._mm_totals = list(state.get("mm_totals", [0.0, 0]))
        b = state.get("batch")
        if b:
            micro = [GrpoBatch(**d) for d in b["micro"]]
            self.batch = _Rollouts(index=b["index"], micro=micro,
                                   old={int(i): t.to(self.st.device) for i, t in b["old"].items()},
                                   fields=b["fields"], mm=b["mm"], gaps=b["gaps"],
                                   row_start=b.get("row_start", 0))


def _prompt_text(prompt: Any) -> str:
    """A prompt for the rollout table: the text, or a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else str(prompt)


__all__ = ["GrpoBatch", "GrpoObjective", "ROLLOUT_FIELDS"]
