"""RejectionSampler: verify a step's draft tokens against the target model, vectorised over [rows, drafts].

Each row b brings n = num_draft_tokens[b] drafts x_1..x_n and the target's distributions p_0..p_n, where p_j is
the distribution of the token after x_1..x_j (already processed: penalties, temperature, truncation). It emits
the accepted drafts and exactly one token of the target's own: the recovered token at the first rejection, or the
bonus token from p_n when every draft is kept. q_j is the drafter's distribution that proposed x_{j+1}
(draft_probs), or one-hot at the draft for drafters without probabilities (ngram).

Modes:
  greedy rows      keep x_{j+1} while it is the first argmax of the logits at position j, then emit that argmax:
                   token for token what non-speculative greedy decoding produces; no randomness is drawn.
  standard         (Leviathan et al. 2023; lossless) keep x_{j+1} while u_j < p_j(x_{j+1}) / q_j(x_{j+1}); at
                   the first rejection sample from norm(max(p_j - q_j, 0)).
  block verify     (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025; lossless)
                   decides on the whole block at once, so it can keep a prefix past a draft that the token-wise
                   test would have rejected; its expected number of kept drafts is at least the standard's.
  entropy verify   LOSSY: multiplies each uniform by tau_j = min(exp(-posterior_alpha * H_j), posterior_threshold),
                   H_j the entropy of the target's raw (unprocessed) distribution at position j, so drafts are
                   accepted more easily where the target is uncertain. Outputs are then no longer distributed as
                   the target's. Combines with either standard or block verify.

Block verify. With weights w_0 = 1, w_i = min(w_{i-1} * p_{i-1}(x_i) / q_{i-1}(x_i), 1), residual masses
R_i = sum_x max(w_i p_i(x) - q_i(x), 0), and h_i = R_i / (R_i + 1 - w_i) for i < n, h_n = w_n: draw eta_1..eta_n
uniform, keep x_1..x_tau for tau the last i with eta_i < h_i (0 if none), then emit a token from
norm(max(w_tau p_tau - q_tau, 0)) (q_n = 0: the bonus token from p_n). Why it is lossless: by induction from
i = n down, P(tau >= i | x_1..x_i) = w_i, because E_{x ~ q_i}[w_{i+1}] = sum_x min(w_i p_i(x), q_i(x)) = w_i - R_i
and h_i is exactly the chance that makes up the rest. So a prefix y_1..y_i is kept with probability
q(y_1..y_i) w_i, and it is cut right after y_i with the next token y with probability
q(y_1..y_i) max(w_i p_i(y) - q_i(y), 0); the two add up to q(y_1..y_i) w_i p_i(y), i.e. each emitted token
follows p given the tokens before it, as without speculation.

Randomness, per random row and call, in this order: one noise vector E = -log(U) of vocabulary size, which picks
the single recovered-or-bonus token through the exponential race first_argmax(r / E) (r need not be normalised),
then n uniforms for the acceptance tests. Seeded rows draw both from their own generator and nothing else, so
their tokens do not depend on the batch, its padding or the other rows; a row without drafts picks exactly what
pagedserve.sample.sampler.random_sample picks from the same generator. When any random row is unseeded, the global
RNG gives two draws for all random rows (the noise, then the uniforms; seeded rows overwrite theirs), so unseeded
rows are reproducible under torch.manual_seed. Greedy rows draw nothing.

Uniform draws lie in [0, 1), so the tests are strict (u < ratio): a test passes with probability min(ratio, 1),
and a token the target cannot emit (ratio 0) is never accepted, even for u = 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.sample.greedy import first_argmax

__all__ = ["PLACEHOLDER_TOKEN_ID", "RejectionSampler", "RejectionSamplerOutput"]

# Pads draft rows past their drafts and output rows past their emitted tokens. A placeholder inside a row's drafts
# means "no draft here": it is always rejected and q at its position counts as 0, so the row is verified exactly
# as if its drafts ended just before it.
PLACEHOLDER_TOKEN_ID = -1
# Inside the entropy's logarithm, so that zero probabilities add 0 instead of 0 * -inf = NaN.
ENTROPY_EPSILON = 1e-10


@dataclass
class RejectionSamplerOutput:
    """output_token_ids: [num_rows, max_num_draft_tokens + 1] int64; row b holds its num_accepted_tokens[b]
    accepted drafts, then one recovered-or-bonus token, then PLACEHOLDER_TOKEN_ID.
    num_accepted_tokens: accepted drafts per row (each row emits num_accepted_tokens[b] + 1 tokens)."""

    output_token_ids: torch.Tensor
    num_accepted_tokens: list[int]


class RejectionSampler:
    """Verifies draft tokens against the target's distributions (module docstring); stateless between calls."""

    def __init__(self, enable_block_verify: bool = False, enable_entropy_verify: bool = False,
                 posterior_threshold: float = 0.95, posterior_alpha: float = 0.4) -> None:
        if not 0.0 < posterior_threshold <= 1.0:
            raise ValueError(f"posterior_threshold={posterior_threshold!r} must be in (0, 1]")
        if not posterior_alpha >= 0.0:  # also rejects NaN
            raise ValueError(f"posterior_alpha={posterior_alpha!r} must be >= 0")
        self.enable_block_verify = enable_block_verify
        self.enable_entropy_verify = enable_entropy_verify
        self.posterior_threshold = float(posterior_threshold)
        self.posterior_alpha = float(posterior_alpha)

    def __call__(
        self,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: list[int],
        target_logits: torch.Tensor,
        draft_probs: torch.Tensor | None,
        is_greedy: torch.Tensor,
        generators: dict[int, torch.Generator],
        raw_target_logits: torch.Tensor | None = None,
    ) -> RejectionSamplerOutput:
        """Verify each row's drafts; returns the emitted tokens (the inputs are not modified).

        draft_token_ids: [B, K] int64; row b's first num_draft_tokens[b] entries are its drafts (a
            PLACEHOLDER_TOKEN_ID among them is a draft that is always rejected), the rest PLACEHOLDER_TOKEN_ID.
        num_draft_tokens: [B] ints in [0, K].
        target_logits: [B, K + 1, V] float32, processed as the sampler would (greedy rows: their argmax is their
            token). Position j of row b scores the token after its first j drafts; positions past
            num_draft_tokens[b] are ignored (they may hold anything, NaN included).
        draft_probs: [B, K, V] float32, the drafter's distribution at each draft position, or None when drafts
            come without probabilities (q is then one-hot at each draft).
        is_greedy: [B] bool; greedy rows verify by argmax.
        generators: row -> generator for seeded random rows; other random rows use the global RNG. Greedy rows'
            generators, if any, are not advanced.
        raw_target_logits: [B, K + 1, V], the logits before temperature and truncation; read (and required) only
            with entropy verify.
        """
        self._check_inputs(draft_token_ids, num_draft_tokens, target_logits, draft_probs, is_greedy, generators,
                           raw_target_logits)
        num_rows, max_num_draft_tokens = draft_token_ids.shape
        device = target_logits.device
        num_drafts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)
        is_greedy_rows = is_greedy.tolist()
        greedy_rows = [row for row in range(num_rows) if is_greedy_rows[row]]
        random_rows = [row for row in range(num_rows) if not is_greedy_rows[row]]

        output_token_ids = torch.empty((num_rows, max_num_draft_tokens + 1), dtype=torch.int64, device=device)
        num_accepted = torch.empty((num_rows,), dtype=torch.int64, device=device)
        if greedy_rows:
            rows = _RowSelection(greedy_rows, num_rows, device)
            group_draft_token_ids = rows.take(draft_token_ids)
            group_accepted, group_tokens = self._verify_greedy(
                group_draft_token_ids, rows.take(num_drafts), rows.take(target_logits))
            rows.put(num_accepted, group_accepted)
            rows.put(output_token_ids, _emitted_rows(group_draft_token_ids, group_accepted, group_tokens))
        if random_rows:
            rows = _RowSelection(random_rows, num_rows, device)
            noise, uniforms = self._draw_randomness(random_rows, num_draft_tokens, generators,
                                                    target_logits.shape[-1], max_num_draft_tokens, device)
            group_draft_token_ids = rows.take(draft_token_ids)
            group_accepted, group_tokens = self._verify_random(
                group_draft_token_ids, rows.take(num_drafts), rows.take(target_logits),
                None if draft_probs is None else rows.take(draft_probs),
                rows.take(raw_target_logits) if self.enable_entropy_verify else None, noise, uniforms)
            rows.put(num_accepted, group_accepted)
            rows.put(output_token_ids, _emitted_rows(group_draft_token_ids, group_accepted, group_tokens))
        return RejectionSamplerOutput(output_token_ids=output_token_ids, num_accepted_tokens=num_accepted.tolist())

    # ---- greedy rows ------------------------------------------------------------------------------------------
    @staticmethod
    def _verify_greedy(draft_token_ids: torch.Tensor, num_drafts: torch.Tensor,
                       target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (accepted drafts [G], emitted token [G]). The argmax is taken on the logits with the sampler's
        first_argmax (ties and NaN resolve alike), so the tokens are exactly non-speculative greedy's."""
        num_rows, max_num_draft_tokens = draft_token_ids.shape
        target_token_ids = first_argmax(target_logits.reshape(-1, target_logits.shape[-1]))
        target_token_ids = target_token_ids.view(num_rows, max_num_draft_tokens + 1)
        is_draft = _draft_positions(num_drafts, max_num_draft_tokens)
        # A placeholder (-1) never equals an argmax, so it is rejected here without a special case.
        is_match = is_draft & (draft_token_ids == target_token_ids[:, :max_num_draft_tokens])
        num_accepted = is_match.long().cumprod(dim=1).sum(dim=1)
        return num_accepted, target_token_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)

    # ---- random rows ------------------------------------------------------------------------------------------
    @staticmethod
    def _draw_randomness(random_rows: list[int], num_draft_tokens: list[int], generators: dict[int, torch.Generator],
                         vocab_size: int, max_num_draft_tokens: int,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (Exp(1) noise [R, V], uniforms [R, K]) for the random rows, drawn as the module docstring says.

        Uniforms past a row's drafts are never read (the callers mask those positions)."""
        noise = torch.empty((len(random_rows), vocab_size), dtype=torch.float32, device=device)
        uniforms = torch.ones((len(random_rows), max_num_draft_tokens), dtype=torch.float32, device=device)
        seeded = [(index, row) for index, row in enumerate(random_rows) if row in generators]
        if len(seeded) < len(random_rows):
            # Seeded rows get global draws too and overwrite them below, as in the sampler: two ops in all.
            noise.uniform_()
            uniforms.uniform_()
        # The only per-row loop: each seeded row advances its own generator by V + n draws, noise first.
        for index, row in seeded:
            generator = generators[row]
            noise[index].uniform_(generator=generator)
            uniforms[index, :num_draft_tokens[row]].uniform_(generator=generator)
        return noise.log_().neg_(), uniforms

    def _verify_random(self, draft_token_ids: torch.Tensor, num_drafts: torch.Tensor, target_logits: torch.Tensor,
                       draft_probs: torch.Tensor | None, raw_target_logits: torch.Tensor | None, noise: torch.Tensor,
                       uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (accepted drafts [R], emitted token [R]) for random rows (standard or block, maybe entropy)."""
        max_num_draft_tokens = draft_token_ids.shape[1]
        target_probs = target_logits.softmax(dim=-1)  # [R, K + 1, V]
        is_draft = _draft_positions(num_drafts, max_num_draft_tokens)
        # Drafts that the drafter really proposed; placeholders count as q = 0 at their position.
        is_proposed = is_draft & (draft_token_ids != PLACEHOLDER_TOKEN_ID)
        safe_token_ids = torch.where(is_proposed, draft_token_ids, 0).unsqueeze(-1)
        target_draft_probs = torch.where(
            is_proposed, target_probs[:, :max_num_draft_tokens].gather(-1, safe_token_ids).squeeze(-1), 0.0)
        if draft_probs is None:
            draft_draft_probs = is_proposed.to(torch.float32)
        else:
            draft_draft_probs = torch.where(is_proposed, draft_probs.gather(-1, safe_token_ids).squeeze(-1), 0.0)
        # A draft the drafter gave no mass (placeholders included) has ratio 0: never accepted.
        has_draft_mass = draft_draft_probs > 0
        ratios = torch.where(has_draft_mass, target_draft_probs / torch.where(has_draft_mass, draft_draft_probs, 1.0),
                             0.0)
        if self.enable_entropy_verify:
            assert raw_target_logits is not None  # checked in _check_inputs
            uniforms = uniforms * self._entropy_thresholds(raw_target_logits[:, :max_num_draft_tokens])

        if self.enable_block_verify:
            weights = _block_weights(ratios)
            num_accepted = self._block_num_accepted(
                weights, ratios, target_probs, target_draft_probs, draft_probs, is_proposed, is_draft, num_drafts,
                uniforms)
        else:
            weights = None
            is_accepted = is_draft & (uniforms < ratios)
            num_accepted = is_accepted.long().cumprod(dim=1).sum(dim=1)
        tokens = self._recovered_or_bonus_tokens(num_accepted, weights, target_probs, draft_probs,
                                                 safe_token_ids.squeeze(-1), is_proposed, noise)
        return num_accepted, tokens

    def _entropy_thresholds(self, raw_target_logits: torch.Tensor) -> torch.Tensor:
        """[R, K, V] raw logits -> [R, K] tau = min(exp(-alpha * H), posterior_threshold)."""
        probs = raw_target_logits.to(torch.float32).softmax(dim=-1)
        entropy = -(probs * (probs + ENTROPY_EPSILON).log()).sum(dim=-1)
        return (entropy * -self.posterior_alpha).exp().clamp(max=self.posterior_threshold)

    @staticmethod
    def _block_num_accepted(weights: torch.Tensor, ratios: torch.Tensor, target_probs: torch.Tensor,
                            target_draft_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                            is_proposed: torch.Tensor, is_draft: torch.Tensor, num_drafts: torch.Tensor,
                            uniforms: torch.Tensor) -> torch.Tensor:
        """tau per row: the last i with eta_i < h_i (module docstring), 0 if none. Entry k of the [R, K] tensors
        below belongs to keeping the first k + 1 drafts."""
        num_rows, max_num_draft_tokens = ratios.shape
        if max_num_draft_tokens == 0:
            return torch.zeros((num_rows,), dtype=torch.int64, device=ratios.device)
        # R_i for i = 1..K-1: the residual mass at the position after the first i drafts.
        next_weights = weights[:, 1:max_num_draft_tokens]
        if draft_probs is None:
            # q one-hot at the draft: sum_x max(w p(x) - [x = draft], 0) = w (1 - p(draft)), as w p(draft) <= 1.
            # A placeholder has q = 0 and p(draft) = 0 here, which gives R = w.
            residual_masses = next_weights * (1.0 - target_draft_probs[:, 1:])
        else:
            # One [R, K - 1, V] temporary, updated in place.
            residuals = next_weights.unsqueeze(-1) * target_probs[:, 1:max_num_draft_tokens]
            residual_masses = residuals.sub_(draft_probs[:, 1:]).clamp_min_(0.0).sum(dim=-1)
            # A placeholder has q = 0: R = w * sum(p) = w.
            residual_masses = torch.where(is_proposed[:, 1:], residual_masses, next_weights)
        denominators = residual_masses + (1.0 - next_weights)
        # A zero denominator (w = 1 and R = 0) means that position's drafter equals the target: the block is never
        # cut there, and h = 0 keeps an all-zero residual from ever being sampled.
        keep_probs = torch.where(denominators > 0, residual_masses / torch.where(denominators > 0, denominators, 1.0),
                                 0.0)
        # Entry k = n - 1 (keep all n drafts) uses h_n = w_n; entries past the drafts never pass (h = 0, strict test).
        keep_probs = torch.cat([keep_probs, keep_probs.new_zeros((num_rows, 1))], dim=1)
        positions = torch.arange(max_num_draft_tokens, device=ratios.device)
        keep_probs = torch.where(positions == (num_drafts - 1).unsqueeze(1), weights[:, 1:], keep_probs)
        is_kept = is_draft & (uniforms < keep_probs)
        return (is_kept.long() * (positions + 1)).amax(dim=1)

    @staticmethod
    def _recovered_or_bonus_tokens(num_accepted: torch.Tensor, weights: torch.Tensor | None,
                                   target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                                   safe_token_ids: torch.Tensor, is_proposed: torch.Tensor,
                                   noise: torch.Tensor) -> torch.Tensor:
        """The one token each random row emits after its accepted drafts, at position t = num_accepted: from
        max(w_t p_t - q_t, 0) (w_t = 1 for standard verification; q_t = 0 past the drafts, which makes it the
        bonus token from p_t), or from p_t should that residual be all zero."""
        num_rows, vocab_size = noise.shape
        max_num_draft_tokens = is_proposed.shape[1]
        positions = num_accepted.unsqueeze(1)
        probs = target_probs.gather(1, positions.unsqueeze(-1).expand(num_rows, 1, vocab_size)).squeeze(1)
        # Without a draft at t the residual is p itself, bit for bit: a row without drafts samples from the very
        # values random_sample would. (The block's w_t p_t differs from p_t by a scale, which the race ignores.)
        residual = probs if weights is None else weights.gather(1, positions) * probs
        if max_num_draft_tokens > 0:
            has_draft = torch.cat([is_proposed, is_proposed.new_zeros((num_rows, 1))], dim=1).gather(1, positions)
            within = positions.clamp(max=max_num_draft_tokens - 1)
            if draft_probs is None:
                # One-hot q: max(w p(x) - [x = draft], 0) is w p with the draft's entry zeroed (w p <= 1).
                draft_token_ids = safe_token_ids.gather(1, within)
                kept_value = torch.where(has_draft, 0.0, residual.gather(1, draft_token_ids))
                residual = residual.scatter(1, draft_token_ids, kept_value)
            else:
                # q at t (a fresh gather, zeroed in place where t holds no draft: its q may be garbage).
                rows_draft_probs = draft_probs.gather(1, within.unsqueeze(-1).expand(num_rows, 1, vocab_size))
                rows_draft_probs = rows_draft_probs.squeeze(1).masked_fill_(~has_draft, 0.0)
                residual = (residual - rows_draft_probs).clamp_min_(0.0)
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, probs)
        return first_argmax(residual.div_(noise))

    # ---- checks -----------------------------------------------------------------------------------------------
    def _check_inputs(self, draft_token_ids: torch.Tensor, num_draft_tokens: list[int], target_logits: torch.Tensor,
                      draft_probs: torch.Tensor | None, is_greedy: torch.Tensor,
                      generators: dict[int, torch.Generator], raw_target_logits: torch.Tensor | None) -> None:
        if draft_token_ids.dim() != 2 or draft_token_ids.dtype != torch.int64:
            raise ValueError(f"draft_token_ids.shape={tuple(draft_token_ids.shape)} dtype={draft_token_ids.dtype} "
                             "must be (num_rows, max_num_draft_tokens) int64")
        num_rows, max_num_draft_tokens = draft_token_ids.shape
        if len(num_draft_tokens) != num_rows:
            raise ValueError(f"len(num_draft_tokens)={len(num_draft_tokens)} must equal num_rows={num_rows} "
                             "(draft_token_ids.shape[0])")
        for row, count in enumerate(num_draft_tokens):
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= max_num_draft_tokens:
                raise ValueError(f"num_draft_tokens[{row}]={count!r} must be an integer in "
                                 f"[0, {max_num_draft_tokens}] (max_num_draft_tokens)")
        if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (num_rows, max_num_draft_tokens + 1) \
                or target_logits.shape[2] < 1 or target_logits.dtype != torch.float32:
            raise ValueError(f"target_logits.shape={tuple(target_logits.shape)} dtype={target_logits.dtype} must be "
                             f"({num_rows}, {max_num_draft_tokens + 1}, vocab_size) float32 "
                             "(num_rows, max_num_draft_tokens + 1, vocab_size)")
        vocab_size = target_logits.shape[2]
        expected_draft_shape = (num_rows, max_num_draft_tokens, vocab_size)
        if draft_probs is not None and (tuple(draft_probs.shape) != expected_draft_shape
                                        or draft_probs.dtype != torch.float32):
            raise ValueError(f"draft_probs.shape={tuple(draft_probs.shape)} dtype={draft_probs.dtype} must be "
                             f"{expected_draft_shape} float32 (num_rows, max_num_draft_tokens, vocab_size), or None")
        if tuple(is_greedy.shape) != (num_rows,) or is_greedy.dtype != torch.bool:
            raise ValueError(f"is_greedy.shape={tuple(is_greedy.shape)} dtype={is_greedy.dtype} must be "
                             f"({num_rows},) bool")
        for row in generators:
            if not 0 <= row < num_rows:
                raise ValueError(f"generators has row {row!r}, outside [0, {num_rows})")
        if self.enable_entropy_verify:
            expected_raw_shape = (num_rows, max_num_draft_tokens + 1, vocab_size)
            if raw_target_logits is None:
                raise ValueError("raw_target_logits=None: entropy verify needs the raw target logits, shape "
                                 f"{expected_raw_shape} (num_rows, max_num_draft_tokens + 1, vocab_size)")
            if tuple(raw_target_logits.shape) != expected_raw_shape or not raw_target_logits.is_floating_point():
                raise ValueError(f"raw_target_logits.shape={tuple(raw_target_logits.shape)} "
                                 f"dtype={raw_target_logits.dtype} must be {expected_raw_shape} floating point")
        for name, tensor in (("draft_token_ids", draft_token_ids), ("draft_probs", draft_probs),
                             ("is_greedy", is_greedy), ("raw_target_logits", raw_target_logits)):
            if tensor is not None and tensor.device != target_logits.device:
                raise ValueError(f"{name}.device={tensor.device} must be target_logits.device={target_logits.device}")
        num_drafts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=draft_token_ids.device)
        is_out_of_range = _draft_positions(num_drafts, max_num_draft_tokens) \
            & (draft_token_ids != PLACEHOLDER_TOKEN_ID) & ((draft_token_ids < 0) | (draft_token_ids >= vocab_size))
        if bool(is_out_of_range.any()):
            row, position = is_out_of_range.nonzero()[0].tolist()
            raise ValueError(f"draft_token_ids[{row}, {position}]={int(draft_token_ids[row, position])} must be a "
                             f"token id in [0, {vocab_size}) or PLACEHOLDER_TOKEN_ID={PLACEHOLDER_TOKEN_ID}")


class _RowSelection:
    """A subset of the batch's rows (greedy or random): takes their slices of [B, ...] tensors and writes results
    back. When it is the whole batch, the tensors are used as they are (no copy)."""

    def __init__(self, rows: list[int], num_rows: int, device: torch.device) -> None:
        self.is_everything = len(rows) == num_rows
        self.index = None if self.is_everything else torch.tensor(rows, dtype=torch.int64, device=device)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.index is None else tensor.index_select(0, self.index)

    def put(self, destination: torch.Tensor, values: torch.Tensor) -> None:
        if self.index is None:
            destination.copy_(values)
        else:
            destination.index_copy_(0, self.index, values)


def _draft_positions(num_drafts: torch.Tensor, max_num_draft_tokens: int) -> torch.Tensor:
    """[rows, K] bool: position j holds one of the row's drafts (j < num_drafts)."""
    return torch.arange(max_num_draft_tokens, device=num_drafts.device) < num_drafts.unsqueeze(1)


def _block_weights(ratios: torch.Tensor) -> torch.Tensor:
    """[R, K] ratios p/q -> [R, K + 1] weights w_0 = 1, w_i = min(w_{i-1} * ratio_i, 1), without a loop over K.

    In logs, l_i = min(l_{i-1} + a_i, 0) with l_0 = 0 is solved by l_i = S_i - max(S_0..S_i), S the cumulative
    sum of a_i = log(ratio_i) with S_0 = 0. A zero ratio makes S (and so w) -inf (0) from there on; ratios >= 1
    throughout give S_i = max(S_0..S_i), so w stays exactly 1."""
    log_ratios = ratios.log()
    cumulative = torch.cat([log_ratios.new_zeros((ratios.shape[0], 1)), log_ratios.cumsum(dim=1)], dim=1)
    return (cumulative - cumulative.cummax(dim=1).values).exp()


def _emitted_rows(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[rows, K + 1]: the accepted drafts, the emitted token at position num_accepted, PLACEHOLDER_TOKEN_ID after."""
    num_rows, max_num_draft_tokens = draft_token_ids.shape
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((num_rows, 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    positions = torch.arange(max_num_draft_tokens + 1, device=draft_token_ids.device)
    rows = torch.where(positions < num_accepted.unsqueeze(1), padded, PLACEHOLDER_TOKEN_ID)
    return rows.scatter(1, num_accepted.unsqueeze(1), tokens.unsqueeze(1))
