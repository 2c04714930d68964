"""Train a draft head on logged traffic, within a CPU-time budget, with a held-out split.

The log holds token ids only (prompt + the completion the target served). The target's own
final-normed states and next-token distributions are recomputed here offline, in one causal
pass per conversation (the dense teacher of draft_model.py, every target layer): the serving
engine is never asked for a second forward. Labels are the target's top-k distribution, not
the logged token, so sampled completions still teach the target's greedy choices.

Loss per slot (EAGLE): soft cross-entropy of the head's logits against the target's top-k
next-token distribution restricted to the head vocabulary, plus a smooth-L1 regression of
the predicted state onto the target's next state (what chained guesses feed back in).
Each training window starts at a random point of the prompt, because serving hands the
head no states for a prefix served from cache (head_proposer.py), and a little uniform noise
on the input states stands in for the error of chained predictions.

The held-out split is by chat, by a hash of its first prompt (training_log.split_heldout),
the slice `splitserve draft gate` replays. Budget and learning rate follow CPU time
(time.process_time) as in draft_train.py.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kvcache.pool import KVPool
from engine.model.gguf_file import Checkpoint
from engine.model.llama import LlamaModel
from engine.speculative.draft_data import TeacherSample, build_vocab, target_to_draft_map
from engine.speculative.draft_model import model_from_checkpoint
from engine.speculative.draft_train import clock_line, lr_factor
from engine.speculative.head_file import HeadFile, save_head
from engine.speculative.head_model import DraftHead, head_config, init_head_from_checkpoint
from kernels.attention_metadata import AttentionMetadata
from shared.training_log import Conversation, split_heldout


@dataclass(frozen=True)
class HeadTrainConfig:
    max_minutes: float = 5.0
    data_share: float = 0.5  # of the budget at most spent recomputing the target's states
    vocab_size: int = 4096
    top_k: int = 8
    # 3e-3 against 1e-3 measured +0.02 and +0.01 held-out agreement after 300 steps (two
    # seeds, 150 logged conversations of bench spec's log); 6e-3 lost 0.015.
    lr: float = 3e-3
    # Peak learning rate of a run that goes on from a trained head (`init`; None: `lr`). At
    # `lr` a warm start first undid what the head knew: an adaptation round from the bench's
    # 30-CPU-minute head, bench spec's whole log, fell from 0.455 held-out agreement to
    # 0.36-0.39 (sampled) over its first 186 steps; on the log's latest 300 turns (7 CPU-min,
    # ~300 steps, 19 held-out chats) 3e-3 ended at 0.800 -> 0.753 (0.75-0.81 sampled on the
    # way), 1e-3 at 0.800 -> 0.795 (0.84-0.87 sampled).
    lr_continued: float | None = 1e-3
    weight_decay: float = 0.0
    window: int = 256  # slots per training window
    batch_windows: int = 4
    regression_weight: float = 1.0
    chain_steps: int = 3  # guesses of a chain trained as served (DraftHead.forward_chained)
    noise: float = 0.05  # uniform input-state noise, as a fraction of the states' RMS
    heldout_fraction: float = 0.1
    # Label prompt positions too (the target's distribution there is as much its behaviour
    # as in replies; a chat log's prompts are mostly earlier turns), not only replies.
    # (Weighting prompt positions down, 0.25 against a reply's 1, was measured to lose:
    # held-out agreement 0.388 against 0.408 after ~420 steps on bench spec's log.)
    label_prompt: bool = True
    seed: int = 0
    max_steps: int | None = None  # stop after this many optimizer steps (tests)
    # "auto": time one training step in fp32 and under bf16 autocast at the start and keep
    # the faster (AMX/AVX512-BF16 machines run bf16 GEMMs ~3x faster; AVX2 ones ~6x slower,
    # so no fixed choice is right everywhere); "fp32" or "bf16" pins it.
    precision: str = "auto"


@dataclass
class HeadSample:
    # ids, the first labelled position (the prompt length, or 1 when prompt tokens are
    # labelled too), top-k from the position before each labelled token
    teacher: TeacherSample
    states: torch.Tensor  # [len(token_ids), H] the target's final-normed states (bf16)
    reply_from: int = 0  # the logged prompt length: held-out agreement counts replies only


@dataclass
class HeadTrainReport:
    path: Path
    num_conversations: int
    train_tokens: int
    heldout_tokens: int
    steps: int
    heldout_agreement: float  # head top-1 == target top-1, first guess, held-out replies
    initial_agreement: float
    elapsed_s: float  # CPU seconds
    wall_s: float
    extra: dict = field(default_factory=dict)


@torch.inference_mode()
def target_states(
    checkpoint: Checkpoint,
    conversations: Sequence[tuple[list[int], int]],
    top_k: int,
    stop: Callable[[], bool],
    log: Callable[[str], None],
    batch: int = 8,
    serving: LlamaModel | None = None,
    label_prompt: bool = False,
) -> list[HeadSample]:
    """The target's states and top-k next-token distributions over each (ids, prompt_len),
    as far as `stop()` allows. With `serving`, the serving model's prompt path computes
    them (its weight format and kernels: the states the head is fed when it serves, at
    prefill speed); otherwise a dense fp32 copy of every target layer does."""
    if serving is not None:
        return _serving_states(serving, conversations, top_k, stop, log, label_prompt)
    teacher = model_from_checkpoint(
        checkpoint, tuple(range(checkpoint.config.num_layers)), None
    ).eval()
    out: list[HeadSample] = []
    tokens = 0
    limit = checkpoint.config.max_position
    pending = [(ids[:limit], p) for ids, p in conversations]
    for start in range(0, len(pending), batch):
        if stop():
            break
        group = pending[start : start + batch]
        width = max(len(ids) for ids, _ in group)
        # Right padding under causal attention: a row's real positions never see its padding.
        padded = torch.zeros(len(group), width, dtype=torch.long)
        for row, (ids, _) in enumerate(group):
            padded[row, : len(ids)] = torch.tensor(ids)
        hidden = teacher(padded)
        for row, (ids, prompt_len) in enumerate(group):
            states = hidden[row, : len(ids)]
            out.append(_sample(ids, prompt_len, states, teacher.logits, top_k, label_prompt))
            tokens += len(ids)
        log(f"[head] target states: {len(out)} conversations, {tokens} tokens")
    return out


def _sample(
    ids: list[int],
    prompt_len: int,
    states: torch.Tensor,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    top_k: int,
    label_prompt: bool,
) -> HeadSample:
    # Token j's label is the distribution at the position before it; one row more labels
    # what follows the last token (a head slot predicts two ahead).
    first = 1 if label_prompt else prompt_len
    top_ids, top_logprobs = _top_k(logits_of, states[first - 1 :], top_k)
    return _labelled(ids, prompt_len, first, states, top_ids, top_logprobs)


def _top_k(
    logits_of: Callable[[torch.Tensor], torch.Tensor], states: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.log_softmax(logits_of(states).float(), dim=-1).topk(k, dim=-1)
    return top.indices, top.values


def _labelled(
    ids: list[int],
    prompt_len: int,
    first: int,
    states: torch.Tensor,
    top_ids: torch.Tensor,
    top_logprobs: torch.Tensor,
) -> HeadSample:
    teacher_sample = TeacherSample(ids, first, top_ids, top_logprobs)
    return HeadSample(teacher_sample, states.to(torch.bfloat16).clone(), prompt_len)


# Prompt-path chunk: the serving engine's own prefill budget per step.
_CHUNK = 512


@torch.inference_mode()
def _serving_states(
    model: LlamaModel,
    conversations: Sequence[tuple[list[int], int]],
    top_k: int,
    stop: Callable[[], bool],
    log: Callable[[str], None],
    label_prompt: bool,
) -> list[HeadSample]:
    """As the serving engine's prefix cache does: a conversation's positions shared with the
    one computed before it (a chat's next turn resends the last one whole) keep their KV and
    states, and only the rest is computed. `prefix_order` puts each turn right after the
    one it extends."""
    block = 16
    limit = model.config.max_position
    longest = min(limit, max(len(ids) for ids, _ in conversations))
    table = list(range(-(-longest // block)))
    pool = KVPool(model.kv_layout(block, torch.float32), len(table))
    out: list[HeadSample] = []
    tokens = computed = 0
    last_log = time.monotonic()
    previous: list[int] = []
    previous_states = torch.empty(0, model.config.hidden_size)
    previous_first = 1
    previous_top = (torch.empty(0, top_k, dtype=torch.long), torch.empty(0, top_k))
    logits_of = lambda h: model.logits(h, decode=False)  # noqa: E731
    for ids, prompt_len in conversations:
        if stop():
            break
        ids = ids[:limit]
        # The pool holds `previous`'s KV at positions [0, len(previous)): the shared ones
        # are this conversation's too (causal attention: a position sees only those before).
        shared = _common_prefix(previous, ids)
        parts = [previous_states[:shared]]
        for a in range(shared, len(ids), _CHUNK):
            chunk = ids[a : a + _CHUNK]
            meta = AttentionMetadata([len(chunk)], [a + len(chunk)], [table], block)
            parts.append(model.forward_path(torch.tensor(chunk), meta, pool, decode=False).float())
        states = torch.cat(parts)
        # Labels: the distributions at positions first - 1 .. len(ids) - 1. Those of shared
        # positions are the previous conversation's (it labelled from `previous_first`).
        first = 1 if label_prompt else prompt_len
        reused = max(0, shared - (first - 1)) if previous_first <= first else 0
        taken = slice(first - previous_first, first - previous_first + reused)
        top_ids, top_logprobs = previous_top[0][taken], previous_top[1][taken]
        if first - 1 + reused < len(ids):  # else a turn already computed whole
            new_ids, new_logprobs = _top_k(logits_of, states[first - 1 + reused :], top_k)
            top_ids = torch.cat([top_ids, new_ids])
            top_logprobs = torch.cat([top_logprobs, new_logprobs])
        previous, previous_states = ids, states
        previous_first, previous_top = first, (top_ids, top_logprobs)
        out.append(_labelled(ids, prompt_len, first, states, top_ids, top_logprobs))
        tokens += len(ids)
        computed += len(ids) - shared
        if time.monotonic() - last_log > 10:
            last_log = time.monotonic()
            log(f"[head] target states: {len(out)} conversations, {tokens} tokens")
    log(
        f"[head] target states: {len(out)} conversations, {tokens} tokens "
        f"({computed} computed, the rest shared with the turn before)"
    )
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def prefix_order(chats: Sequence[Sequence[Conversation]], rng: random.Random) -> list[Conversation]:
    """The chats' turns (training_log.group_chats), each chat's together and in order, the
    chats in random order: state recomputation then shares every resent prefix, and a budget
    that runs out cuts whole chats drawn at random, not one end of a sorted list."""
    shuffled = list(chats)
    rng.shuffle(shuffled)
    return [turn for chat in shuffled for turn in chat]


def train_head(
    checkpoint: Checkpoint,
    conversations: Sequence[tuple[list[int], int]],
    out: str | Path,
    target_fingerprint: str,
    stop_ids: frozenset[int] = frozenset(),
    config: HeadTrainConfig = HeadTrainConfig(),
    log: Callable[[str], None] = print,
    serving: LlamaModel | None = None,
    init: HeadFile | None = None,
) -> HeadTrainReport:
    """`serving`: the model as it serves (its format and kernels) computes the states the
    head learns from; without it, a dense fp32 copy of the checkpoint's layers does.
    `init`: a head to go on training (its weights and vocabulary) instead of starting from
    the target's last layer: each round of online adaptation adds its budget's steps to what
    the rounds before learned, which one CPU budget alone could not buy."""
    torch.manual_seed(config.seed)
    start, wall_start = time.process_time(), time.monotonic()
    budget = config.max_minutes * 60.0
    usable = [(ids, p) for ids, p in conversations if 1 <= p < len(ids)]
    if len(usable) < 2:
        raise ValueError("training needs at least 2 logged conversations with a completion")
    held_chats, train_chats = split_heldout(usable, config.heldout_fraction)
    if not held_chats or not train_chats:  # tiny logs: the last conversation is held out
        held_chats, train_chats = [[c] for c in usable[-1:]], [[c] for c in usable[:-1]]
    rng = random.Random(config.seed)
    held_in, train_in = prefix_order(held_chats, rng), prefix_order(train_chats, rng)
    data_deadline = start + budget * config.data_share
    # Held-out first: a budget that runs out while recomputing states cuts training data.
    samples = target_states(
        checkpoint,
        held_in + train_in,
        config.top_k,
        lambda: time.process_time() > data_deadline,
        log,
        serving=serving,
        label_prompt=config.label_prompt,
    )
    held, train = samples[: len(held_in)], samples[len(held_in) :]
    if not train:
        raise ValueError("the budget allowed no training conversations; raise --max-minutes")
    tc = checkpoint.config
    if init is not None:
        vocab_ids = init.vocab_ids
        if init.config != head_config(tc, len(vocab_ids)):
            raise ValueError("the head to go on training was made for another target's shapes")
        head = init.build_head().requires_grad_(True).train()
    else:
        vocab_ids = build_vocab([s.teacher for s in train], config.vocab_size, sorted(stop_ids))
        head = DraftHead(head_config(tc, len(vocab_ids)))
        init_head_from_checkpoint(head, checkpoint.tensors)
    to_head = target_to_draft_map(vocab_ids, tc.vocab_size)
    t = checkpoint.tensors
    head.attach_target(t["embed_tokens"], t.get("lm_head", t["embed_tokens"])[vocab_ids])
    train_tokens = sum(len(s.teacher.token_ids) - s.reply_from for s in train)
    held_tokens = sum(len(s.teacher.token_ids) - s.reply_from for s in held)
    log(
        f"[head] data: {len(train)} train / {len(held)} held-out conversations, "
        f"{train_tokens} train reply tokens, vocab {len(vocab_ids)}, "
        f"{clock_line(start, wall_start, budget)}"
    )
    held_windows = [_window(s, 0, len(s.teacher.token_ids), to_head) for s in held]
    # Progress lines score a fixed sample of the held-out chats: all 81 of bench spec's log
    # every 20 CPU-s took about a third of the training budget (2.4 CPU-s a step against
    # 1.5); the start and the end are scored on all of them.
    progress_windows = random.Random(config.seed).sample(
        held_windows, min(len(held_windows), _PROGRESS_SAMPLE)
    )
    initial = _agreement(head, held_windows, vocab_ids)
    # A fixed slice of training data, noise off: is the optimiser working at all?
    probe = _pad([_window(s, 0, len(s.teacher.token_ids), to_head) for s in train[:8]])
    exact = HeadTrainConfig(noise=0.0, regression_weight=config.regression_weight)
    initial_train_loss = _mean_loss(head, probe, exact)
    log(f"[head] before training: held-out first-guess agreement {initial:.3f}")
    params = [p for p in head.parameters() if p.requires_grad]
    peak_lr = config.lr
    if init is not None and config.lr_continued is not None:
        peak_lr = config.lr_continued
    opt = torch.optim.AdamW(params, lr=peak_lr, weight_decay=config.weight_decay)
    precision, timings = choose_precision(head, train, to_head, config, rng)
    log(f"[head] training precision {precision} ({_timing_line(timings)})")
    train_start = time.process_time()
    train_budget = max(1e-3, start + budget - train_start)
    step, last_log, loss_avg = 0, train_start, float("nan")
    while step != config.max_steps:
        frac = (time.process_time() - train_start) / train_budget
        if config.max_steps:
            frac = max(frac, step / config.max_steps)
        if frac >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = peak_lr * lr_factor(frac)
        windows = [
            _sample_window(rng, train, config.window, to_head) for _ in range(config.batch_windows)
        ]
        with _autocast(precision):
            loss = _loss(head, _pad(windows), config)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        value = float(loss.detach())
        loss_avg = value if step == 1 else 0.95 * loss_avg + 0.05 * value
        if time.process_time() - last_log > 30:
            sampled = _agreement(head, progress_windows, vocab_ids)
            last_log = time.process_time()
            log(
                f"[head] step {step}: loss {loss_avg:.3f}, held-out agreement "
                f"{sampled:.3f} (sampled), {clock_line(start, wall_start, budget)}"
            )
    agreement = _agreement(head, held_windows, vocab_ids)
    elapsed = time.process_time() - start
    report = HeadTrainReport(
        path=Path(out),
        num_conversations=len(samples),
        train_tokens=train_tokens,
        heldout_tokens=held_tokens,
        steps=step,
        heldout_agreement=agreement,
        initial_agreement=initial,
        elapsed_s=elapsed,
        wall_s=time.monotonic() - wall_start,
        extra={
            "initial_train_loss": initial_train_loss,
            "final_train_loss": _mean_loss(head, probe, exact),
            "precision": precision,
            "step_seconds": timings,
            "lr": peak_lr,
        },
    )
    earlier_steps = int(init.stats.get("total_steps", init.stats.get("steps", 0))) if init else 0
    stats = {
        "precision": precision,
        "lr": peak_lr,
        "heldout_agreement": agreement,
        "initial_agreement": initial,
        "steps": step,
        "total_steps": earlier_steps + step,  # over every round that led to this head
        "continued_from": init.version if init else None,
        "train_tokens": train_tokens,
        "heldout_tokens": held_tokens,
        "cpu_seconds": round(elapsed, 1),
    }
    report.path = save_head(out, head, vocab_ids, target_fingerprint, tc.vocab_size, stats)
    log(f"[head] saved {report.path}: held-out agreement {initial:.3f} -> {agreement:.3f}")
    return report


# Held-out windows a progress line scores.
_PROGRESS_SAMPLE = 12

PRECISIONS = ("auto", "fp32", "bf16")
# bf16 must beat fp32 by this much to be chosen: its rounding costs a little accuracy per
# step, which a near-tie in speed does not pay for.
_BF16_MARGIN = 1.15
# A bf16 warm-up step this many times slower than fp32's best is not timed further.
_HOPELESS = 8.0


@contextlib.contextmanager
def _autocast(precision: str) -> Iterator[None]:
    # Master weights, optimizer state and the loss's softmaxes stay fp32 under autocast;
    # only the linears and attention run in bf16.
    if precision == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    else:
        yield


def choose_precision(
    head: DraftHead,
    train: list[HeadSample],
    to_head: torch.Tensor,
    config: HeadTrainConfig,
    rng: random.Random,
) -> tuple[str, dict[str, float]]:
    """The precision the loop runs in and the measured seconds per step of each candidate.
    Timed on this machine, on a real training batch (forward and backward, gradients then
    discarded), after one warm-up step each: the choice is re-made wherever training runs."""
    if config.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {config.precision!r}")
    if config.precision != "auto":
        return config.precision, {}
    batch = _pad(
        [_sample_window(rng, train, config.window, to_head) for _ in range(config.batch_windows)]
    )
    timings: dict[str, float] = {}
    for candidate in ("fp32", "bf16"):
        seconds = []
        for _ in range(3):
            t0 = time.perf_counter()
            with _autocast(candidate):
                loss = _loss(head, batch, config)
            loss.backward()
            seconds.append(time.perf_counter() - t0)
            if candidate == "bf16" and seconds[0] > _HOPELESS * timings["fp32"]:
                # Even its warm-up's worth of kernel selection cannot explain this much: a
                # CPU without bf16 arithmetic (13.4 s against 0.41 s a step on an AVX2
                # EPYC). Two more such steps would only spend the training budget.
                break
        # The first run is a warm-up (kernel selection, allocation); the best of the rest.
        timings[candidate] = round(min(seconds[1:] or seconds), 4)
        head.zero_grad(set_to_none=True)
    faster = timings["bf16"] * _BF16_MARGIN < timings["fp32"]
    return ("bf16" if faster else "fp32"), timings


def _timing_line(timings: dict[str, float]) -> str:
    if not timings:
        return "pinned"
    return ", ".join(f"{name} {seconds * 1000:.0f} ms/step" for name, seconds in timings.items())


@dataclass
class _Window:
    features: torch.Tensor  # [T, H] target states h_t
    next_ids: torch.Tensor  # [T] x_{t+1}
    next_states: torch.Tensor  # [T, H] h_{t+1} (regression target)
    mask: torch.Tensor  # [T] slots whose prediction has a label
    reply_mask: torch.Tensor  # [T] slots whose prediction is a reply token
    target_ids: torch.Tensor  # [T, k] head ids of the target's top-k for x_{t+2}
    target_probs: torch.Tensor  # [T, k], zero outside the head vocabulary
    top1: torch.Tensor  # [T] the target's top-1 (target id) for x_{t+2}


def _window(s: HeadSample, a: int, b: int, to_head: torch.Tensor) -> _Window:
    """Slots t in [a, b - 1): pair (h_t, x_{t+1}) predicting h_{t+1} and x_{t+2}."""
    ids, p = s.teacher.token_ids, s.teacher.prompt_len
    unk = int(to_head.max())  # target_to_draft_map's id for "outside the vocabulary"
    slots = torch.arange(a, b - 1)
    mask = slots + 2 >= p  # x_{t+2} has a label
    reply_mask = slots + 2 >= s.reply_from
    label_rows = (slots + 2 - p).clamp(min=0, max=s.teacher.top_ids.shape[0] - 1)
    top_ids = s.teacher.top_ids[label_rows]
    mapped = to_head[top_ids]
    probs = s.teacher.top_logprobs[label_rows].exp() * (mapped != unk)
    return _Window(
        features=s.states[a : b - 1].float(),
        next_ids=torch.tensor(ids[a + 1 : b]),
        next_states=s.states[a + 1 : b].float(),
        mask=mask,
        reply_mask=reply_mask,
        target_ids=mapped.clamp(max=unk - 1),
        target_probs=probs,
        top1=top_ids[:, 0],
    )


def _sample_window(
    rng: random.Random, samples: list[HeadSample], length: int, to_head: torch.Tensor
) -> _Window:
    s = rng.choice(samples)
    # The window ends in the reply (what serving drafts) and starts anywhere before.
    ids, p = s.teacher.token_ids, s.reply_from
    end = rng.randint(p + 1, len(ids)) if len(ids) > p + 1 else len(ids)
    lowest = max(0, end - 1 - length)
    a = rng.randint(lowest, max(lowest, min(p - 1, end - 2)))
    return _window(s, a, end, to_head)


def _pad(windows: list[_Window]) -> _Window:
    t = max(w.features.shape[0] for w in windows)

    def stack(name: str) -> torch.Tensor:
        parts = []
        for w in windows:
            x = getattr(w, name)
            pad = [0, 0] * (x.dim() - 1) + [0, t - x.shape[0]]
            parts.append(F.pad(x, pad))
        return torch.stack(parts)

    return _Window(*(stack(n) for n in _Window.__dataclass_fields__))


def _loss(head: DraftHead, w: _Window, config: HeadTrainConfig) -> torch.Tensor:
    features = w.features
    if config.noise:
        rms = features.pow(2).mean().sqrt()
        features = features + (torch.rand_like(features) - 0.5) * 2 * config.noise * rms
    probs = w.target_probs / w.target_probs.sum(-1, keepdim=True).clamp(min=1e-9)
    total = features.new_zeros(())
    steps = head.forward_chained(features, w.next_ids, config.chain_steps)
    for s, predicted in enumerate(steps, start=1):
        mask = w.mask.clone()
        mask[:, : s - 1] = False  # no chain of s guesses ends at the first s - 2 slots
        if not mask.any():
            continue
        logp = torch.log_softmax(head.logits(predicted), dim=-1).gather(-1, w.target_ids)
        ce = -(probs * logp).sum(-1)[mask].mean()
        reg = F.smooth_l1_loss(predicted[mask], w.next_states[mask])
        total = total + ce + config.regression_weight * reg
    return total / len(steps)


@torch.no_grad()
def _mean_loss(head: DraftHead, window: _Window, config: HeadTrainConfig) -> float:
    return float(_loss(head, window, config))


@torch.no_grad()
def _agreement(head: DraftHead, windows: list[_Window], vocab_ids: torch.Tensor) -> float:
    """First-guess top-1 agreement with the target over the windows' reply slots."""
    agree = total = 0
    for w in windows:
        guess = vocab_ids[head.logits(head(w.features[None], w.next_ids[None]))[0].argmax(-1)]
        agree += int((guess[w.reply_mask] == w.top1[w.reply_mask]).sum())
        total += int(w.reply_mask.sum())
    return agree / max(1, total)
