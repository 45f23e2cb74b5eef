"""Rollouts: G sampled completions per prompt through the inference path (chunked prefill
into the KDA state / MLA latent cache, then the jitted decode loop), multi-turn where the
task has tools, recording each sampled token's log-prob and, optionally, the experts every
MoE layer picked for every token.

An episode's token sequence is BOS, the prompt, then the model's turns with the tool's
replies between them. Only the model's tokens are trained on (`train_mask`); prompt, tool
output and padding are context. Arrays are laid out for the training pass: position t
predicts token t + 1, so train_mask[t] and old_logp[t] belong to token t + 1.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.data import tokenizer
from moe_jax.infer.cache import init_cache
from moe_jax.infer.generate import decode_turn, inference_model, make_step, prefill
from moe_jax.rl.tasks import Problem, Task


@dataclasses.dataclass
class Episodes:
  tokens: np.ndarray        # [R, T] int32, PAD after each episode
  segment_ids: np.ndarray   # [R, T] int32: 1 on the episode, 0 on padding
  targets: np.ndarray       # [R, T] int32: the next token (PAD where there is none)
  train_mask: np.ndarray    # [R, T] float32: 1 where the target is a token the model sampled
  old_logp: np.ndarray      # [R, T] float32: that token's log-prob under the rollout policy
  routes: dict | None       # {MoE layer: [R, T, K] int32}: experts picked per position
  completions: list         # [R] str: everything after the prompt (tool output included)
  generated: np.ndarray     # [R] int32: tokens the model sampled (its turns, EOS included)
  tool_calls: np.ndarray    # [R] int32


@dataclasses.dataclass(frozen=True)
class Budget:
  """Sizes that fix every array's shape, so each jitted piece compiles once."""
  max_prompt: int           # prompt tokens (BOS included)
  max_new: int              # sampled tokens per turn
  max_turns: int = 1
  max_tool: int = 32        # tokens of one tool reply

  @property
  def length(self) -> int:
    return self.max_prompt + self.max_turns * self.max_new + (self.max_turns - 1) * self.max_tool


class Sampler:
  """The inference model and its step for one model config. The jitted prefill and decode
  loop are cached on the step, so build one Sampler per config (`sampler`) and reuse it."""

  def __init__(self, model_cfg, record_routes: bool):
    self.model = inference_model(model_cfg)
    self.step = make_step(self.model, record_routes)


@functools.lru_cache(maxsize=8)
def sampler(model_cfg, record_routes: bool) -> Sampler:
  """The Sampler of a (frozen, hashable) model config: repeated runs in one process (tests,
  notebooks, a resumed run) trace and compile its steps once."""
  return Sampler(model_cfg, record_routes)


def rollout(sampler: Sampler, variables, problems: list[Problem], tasks: dict[str, Task],
            key, budget: Budget, *, temperature: float, prefill_chunk: int = 64,
            seq_len: int | None = None, keep_routes: bool = True) -> Episodes:
  """One episode per problem (repeat a problem G times for a group). `variables` are in the
  inference layout (infer.generate.inference_variables). seq_len: the training length
  (≥ budget.length; default budget.length). keep_routes=False drops a recording sampler's
  routes (an evaluation's: it runs the training rollouts' programs, routes unused)."""
  R, T = len(problems), seq_len or budget.length
  if T < budget.length:
    raise ValueError(f"seq_len={T} is shorter than the rollout budget {budget.length}")
  prompt_ids = [tokenizer.encode(p.prompt, eos=False) for p in problems]
  too_long = [len(x) for x in prompt_ids if len(x) > budget.max_prompt]
  if too_long:
    raise ValueError(f"prompts of {max(too_long)} tokens exceed rl.max_prompt_tokens="
                     f"{budget.max_prompt}")
  tokens_RxP = np.full((R, budget.max_prompt), tokenizer.PAD, np.int32)
  for r, ids in enumerate(prompt_ids):
    tokens_RxP[r, :len(ids)] = ids
  lengths_R = np.array([len(x) for x in prompt_ids], np.int32)
  cache = init_cache(sampler.model.cfg, R, budget.length)
  logits_RxV, cache, *recorded = prefill(sampler.step, variables, cache, tokens_RxP, lengths_R,
                                         chunk=prefill_chunk)

  seqs = [list(ids) for ids in prompt_ids]
  sampled = [[0] * len(ids) for ids in prompt_ids]      # 1 where the model sampled the token
  logps = [[0.0] * len(ids) for ids in prompt_ids]
  # Routes as each row's list of [n, K] pieces, joined once at the end.
  routes = ({k: [[v[r, :lengths_R[r]]] for r in range(R)]
             for k, v in jax.device_get(recorded[0]).items()}
            if recorded and keep_routes else None)
  texts, calls = [""] * R, np.zeros(R, np.int32)
  done_R = np.zeros(R, bool)
  stops = tuple(sorted({tuple(s.encode()) for t in tasks.values() for s in t.stop_sequences}))
  for turn in range(budget.max_turns):
    key, sub = jax.random.split(key)
    out = decode_turn(sampler.step, variables, cache, logits_RxV, sub, jnp.asarray(done_R),
                      max_new=budget.max_new, temperature=temperature,
                      stop_sequences=stops if budget.max_turns > 1 else ())
    cache = out["cache"]
    host = jax.device_get({k: v for k, v in out.items() if k != "cache"})
    replies = np.zeros((R, budget.max_tool), np.int32) + tokenizer.PAD
    reply_len = np.zeros(R, np.int32)
    for r in np.flatnonzero(~done_R):
      n = int(host["n_new"][r])
      new = host["tokens"][r, :n]
      seqs[r] += new.tolist()
      sampled[r] += [1] * n
      logps[r] += host["logprobs"][r, :n].tolist()
      if routes is not None:
        for k in routes:
          routes[k][r].append(host["routes"][k][r, :n])
      texts[r] += tokenizer.decode(new)
      reply = None
      if host["stopped_on_sequence"][r] and turn + 1 < budget.max_turns:
        calls[r] += 1
        reply = tasks[problems[r].state["task"]].respond(problems[r], texts[r])
      if reply is None:
        done_R[r] = True
        continue
      ids = tokenizer.encode(reply, bos=False, eos=False)[:budget.max_tool]
      replies[r, :len(ids)], reply_len[r] = ids, len(ids)
      texts[r] += tokenizer.decode(ids)
    if done_R.all():
      break
    logits_RxV, cache, *recorded = prefill(sampler.step, variables, cache, replies, reply_len,
                                           chunk=prefill_chunk, last_BxV=out["logits"])
    reply_routes = jax.device_get(recorded[0]) if routes is not None else {}
    for r in np.flatnonzero(reply_len):
      n = int(reply_len[r])
      seqs[r] += replies[r, :n].tolist()
      sampled[r] += [0] * n
      logps[r] += [0.0] * n
      for k, v in reply_routes.items():
        routes[k][r].append(v[r, :n])
  return _episodes(seqs, sampled, logps, routes, texts, calls, T)


def rollout_in_pieces(sampler: Sampler, variables, problems: list[Problem],
                      tasks: dict[str, Task], key, budget: Budget, *, rows: int,
                      temperature: float, seq_len: int | None = None) -> Episodes:
  """`rollout` (routes dropped) over `problems` in pieces of exactly `rows` episodes, the last
  padded with copies of its final problem (their episodes dropped); piece i samples with
  fold_in(key, i). With `rows` = the GRPO step's prompts × group size, an evaluation runs
  the programs the training rollouts compiled: on a GPU each new batch size compiled its
  prefill and decode loop for about a minute (benchmarks/grpo.md)."""
  n = len(problems)
  if n == 0 or rows < 1:
    raise ValueError(f"rollout_in_pieces needs problems and rows >= 1; got {n} problems, "
                     f"rows={rows}")
  pieces = []
  for i, lo in enumerate(range(0, n, rows)):
    part = problems[lo:lo + rows]
    part = part + [part[-1]] * (rows - len(part))
    pieces.append(rollout(sampler, variables, part, tasks, jax.random.fold_in(key, i), budget,
                          temperature=temperature, seq_len=seq_len, keep_routes=False))
  def joined(name):   # every field is per row (routes were dropped)
    parts = [getattr(e, name) for e in pieces]
    if parts[0] is None:
      return None
    return (np.concatenate(parts) if isinstance(parts[0], np.ndarray)
            else [x for part in parts for x in part])[:n]
  return Episodes(**{f.name: joined(f.name) for f in dataclasses.fields(Episodes)})


def _episodes(seqs, sampled, logps, routes, texts, calls, T) -> Episodes:
  R = len(seqs)
  tokens = np.full((R, T), tokenizer.PAD, np.int32)
  segment_ids = np.zeros((R, T), np.int32)
  targets = np.full((R, T), tokenizer.PAD, np.int32)
  train_mask = np.zeros((R, T), np.float32)
  old_logp = np.zeros((R, T), np.float32)
  route_arrays = None
  if routes is not None:
    K = next(iter(routes.values()))[0][0].shape[-1]
    route_arrays = {k: np.zeros((R, T, K), np.int32) for k in routes}
  for r, seq in enumerate(seqs):
    L = len(seq)
    tokens[r, :L], segment_ids[r, :L] = seq, 1
    targets[r, :L - 1] = seq[1:]
    train_mask[r, :L - 1] = sampled[r][1:]
    old_logp[r, :L - 1] = logps[r][1:]
    if routes is not None:
      for k in routes:
        route_arrays[k][r, :L] = np.concatenate(routes[k][r])
  generated = np.array([sum(s) for s in sampled], np.int32)
  return Episodes(tokens, segment_ids, targets, train_mask, old_logp, route_arrays, texts,
                  generated, calls)
