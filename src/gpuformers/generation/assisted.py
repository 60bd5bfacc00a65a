"""Assisted generation (speculative decoding): a cheap drafter proposes tokens, the model checks them in one forward.

`model.generate(ids, assistant_model=small)` drafts with a smaller model of the same vocabulary;
`model.generate(ids, prompt_lookup_num_tokens=10)` drafts by copying what followed the last n-gram earlier in the
text (no second model). One round, for the single row assisted generation handles (batch 1, as in transformers):

    sequences: [ prompt ... accepted | d0 d1 d2 d3 ]        k = 4 candidates written after the accepted tokens
    target forward over the uncached tokens + d0..d3, logits for the last k + 1 = 5 positions
    processors per position (each sees the text before it) -> target tokens t0..t4
    greedy:   accept d_i while d_i == t_i, then t_n:     d0 d1 | t2       (n = 2 matches, 3 new tokens)
    sampling: accept d_i with probability min(1, p(d_i) / q(d_i)); at the first rejection sample from
              max(p - q, 0) (speculative sampling, arXiv:2211.17192); a prompt-lookup draft has no q: its
              tokens are kept while they equal the target's own samples
    stop checks per accepted token (eos inside the run ends it there) -> streamer -> both caches cropped

Greedy output equals plain greedy generate() token for token, and sampled output has the target's distribution:
the drafter only decides how many tokens one target forward yields. The target's cache keeps the accepted tokens
except the newest (fed in the next round, as in the plain loop); the assistant's cache is cropped when it drafts.

The draft length: `num_assistant_tokens` (20), changed after each round by `num_assistant_tokens_schedule`:
"constant" (transformers' default), "heuristic" (+2 when every candidate was accepted, else -1, at least 1; the
value is written back to `assistant_model.generation_config` so the next call starts from it, as transformers does)
or "heuristic_transient" (the same within one call). The assistant stops a draft early after a token it gives a
probability below `assistant_confidence_threshold` (0.4; None or 0 turns that off), or after eos. These settings
come from the generate() call when it sets them, else from `assistant_model.generation_config` (where transformers
reads them).

Offers: CandidateGenerator, AssistedCandidateGenerator, PromptLookupCandidateGenerator, assisted_decoding,
check_assisted_generation, speculative_sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpuformers.generation.cache import DynamicCache
from gpuformers.generation.config import GenerationConfig
from gpuformers.generation.generate import GenerateDecoderOnlyOutput, count_length_criteria, greedy_tokens


class CandidateGenerator:
    """Proposes the next tokens of the single row being generated."""

    def get_candidates(self, sequences: torch.Tensor, length: int,
                       limit: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to `limit` candidates to follow sequences[0, :length] (sequences: (1, max_length), written up to
        `length`), as a (k,) LongTensor, with the drafter's processed scores (k, vocab) when it has a
        distribution (needed by speculative sampling), else None. May write into sequences[:, length:]."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_candidates(sequences, length, limit)")

    def update_candidate_strategy(self, num_candidates: int, num_matches: int) -> None:
        """Told after each round how many of the `num_candidates` the target accepted."""

    def end(self) -> None:
        """Called once generation finishes."""


class AssistedCandidateGenerator(CandidateGenerator):
    """Drafts with an assistant model: greedy or sampled as the target decodes, through the same logits
    processors, over the assistant's own KV cache (a DynamicCache kept across rounds and cropped to the
    accepted text)."""

    def __init__(self, assistant_model, config: GenerationConfig, processors, positions: torch.Tensor,
                 mask: torch.Tensor | None, vocab_size: int):
        self.assistant_model = assistant_model
        self.device = assistant_model.get_input_embeddings().weight.device
        own = getattr(assistant_model, "generation_config", None)

        def setting(name: str):
            # the generate() call wins when it set the field; else the assistant's config (transformers' place)
            return getattr(config, name) if config.is_set(name) or own is None else getattr(own, name)

        self.num_assistant_tokens = int(setting("num_assistant_tokens"))
        self.schedule = setting("num_assistant_tokens_schedule")
        self.confidence_threshold = setting("assistant_confidence_threshold") or 0.0
        self.do_sample = config.do_sample
        self.processors = processors
        self.eos = torch.tensor(config.eos_token_ids, dtype=torch.long, device=positions.device)
        self.positions = positions.to(self.device)  # (1, max_length), shared with the target
        self.mask = mask.to(self.device) if mask is not None else None
        self.cache = DynamicCache()
        self.vocab_size = vocab_size  # the target's: drafts are scored over its vocabulary

    def get_candidates(self, sequences, length, limit):
        count = min(self.num_assistant_tokens, limit)
        if count <= 0:
            return sequences.new_empty(0), None
        # Keep what the cache holds of the accepted text; the newest accepted token is always fed again.
        self.cache.crop(min(self.cache.get_seq_length(), length - 1))
        start = self.cache.get_seq_length()
        draft_scores = []
        drafted = 0
        while drafted < count:
            end = length + drafted
            outputs = self.assistant_model(
                input_ids=sequences[:, start:end].to(self.device), position_ids=self.positions[:, start:end],
                attention_mask=self.mask[:, :end] if self.mask is not None else None,
                past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            # scored on the target's device, where the processors and the sequences live
            logits = outputs.logits[:, -1].float().to(sequences.device)  # (1, assistant vocab)
            if logits.shape[-1] < self.vocab_size:  # a smaller assistant vocab: its missing tokens get p = 0
                logits = F.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=-float("inf"))
            scores = self.processors(sequences[:, :end], logits) if self.processors else logits
            if self.do_sample:
                probs = F.softmax(scores, dim=-1)
                token = torch.multinomial(probs, num_samples=1).squeeze(1)
                draft_scores.append(scores)
            else:
                token = greedy_tokens(scores)
            sequences[:, end] = token
            drafted += 1
            start = end
            # transformers' assistant stops after eos and after a token it is not confident of
            stop = torch.isin(token, self.eos) if len(self.eos) else None
            if self.confidence_threshold > 0:
                probs = probs if self.do_sample else F.softmax(scores, dim=-1)
                unsure = probs.gather(1, token[:, None])[:, 0] < self.confidence_threshold
                stop = unsure if stop is None else stop | unsure
            if stop is not None and bool(stop.any()):
                break
        candidates = sequences[0, length:length + drafted].clone()
        return candidates, torch.cat(draft_scores) if self.do_sample else None

    def update_candidate_strategy(self, num_candidates, num_matches):
        if self.schedule in ("heuristic", "heuristic_transient"):
            if num_matches == num_candidates:
                self.num_assistant_tokens += 2
            else:
                self.num_assistant_tokens = max(1, self.num_assistant_tokens - 1)

    def end(self):
        own = getattr(self.assistant_model, "generation_config", None)
        if self.schedule == "heuristic" and own is not None:
            own.num_assistant_tokens = self.num_assistant_tokens  # the next call starts from here (transformers)


class PromptLookupCandidateGenerator(CandidateGenerator):
    """Drafts by n-gram lookup (prompt lookup decoding): find the newest `max_matching_ngram_size`-gram (then
    shorter ones) earlier in the text, first occurrence first, and propose the up to `num_output_tokens` tokens
    that followed it, cut before the first eos. No distribution, so sampling keeps candidates that equal the
    target's own samples."""

    def __init__(self, num_output_tokens: int = 10, max_matching_ngram_size: int = 2,
                 eos_token_ids: list[int] | None = None):
        if num_output_tokens < 1 or max_matching_ngram_size < 1:
            raise ValueError(
                f"prompt lookup needs prompt_lookup_num_tokens >= 1 and max_matching_ngram_size >= 1, got "
                f"{num_output_tokens} and {max_matching_ngram_size}"
            )
        self.num_output_tokens = num_output_tokens
        self.max_matching_ngram_size = max_matching_ngram_size
        self.eos_token_ids = list(eos_token_ids or [])

    def get_candidates(self, sequences, length, limit):
        count = min(self.num_output_tokens, limit)
        text = sequences[0, :length]
        none = sequences.new_empty(0)
        if count <= 0:
            return none, None
        for size in range(min(self.max_matching_ngram_size, length - 1), 0, -1):
            windows = text.unfold(0, size, 1)  # (length - size + 1, size)
            # the last window is the n-gram itself: nothing follows it yet
            hits = (windows[:-1] == text[length - size:]).all(dim=1).nonzero()
            if len(hits):
                begin = int(hits[0]) + size
                candidates = text[begin:min(begin + count, length)]
                if self.eos_token_ids:
                    is_eos = torch.isin(candidates, torch.tensor(self.eos_token_ids, device=candidates.device))
                    first = is_eos.nonzero()
                    if len(first):
                        candidates = candidates[:int(first[0])]
                if len(candidates):
                    return candidates.clone(), None
        return none, None


def check_assisted_generation(model, assistant_model, config: GenerationConfig, batch: int) -> None:
    """Raise for what assisted generation cannot do (the errors say what to change)."""
    if assistant_model is not None and config.prompt_lookup_num_tokens is not None:
        raise ValueError(
            f"pass either assistant_model= or prompt_lookup_num_tokens= (got {config.prompt_lookup_num_tokens}), not "
            f"both: each is a way to draft tokens"
        )
    how = "assistant_model=" if assistant_model is not None else "prompt_lookup_num_tokens="
    for role, m in (("model", model), ("assistant_model", assistant_model)):
        if getattr(m, "is_stateful", False):
            raise NotImplementedError(
                f"assisted generation ({how}) is not implemented for {role} {type(m).__name__}, a state-space model: "
                f"rejecting drafted tokens needs its conv and SSM states rolled back (state rollback), which its "
                f"cache does not keep; drop {how}")
    if config.num_beams > 1:
        raise NotImplementedError(
            f"assisted generation ({how}) does not support beam search (num_beams={config.num_beams}), as in "
            f"transformers; use num_beams=1 (greedy or do_sample=True), or drop {how}"
        )
    if batch > 1:
        raise ValueError(
            f"assisted generation ({how}) handles one prompt at a time (batch size 1, as in transformers), got a "
            f"batch of {batch}; call generate() once per prompt, or drop {how} to decode the batch together"
        )
    if config.num_return_sequences > 1:
        raise ValueError(
            f"assisted generation ({how}) returns one sequence, got num_return_sequences="
            f"{config.num_return_sequences}; call generate() once per sample, or drop {how}"
        )
    if not config.use_cache:
        raise ValueError(f"assisted generation ({how}) needs the KV cache; leave use_cache=True")
    if assistant_model is not None:
        if not isinstance(assistant_model, torch.nn.Module) or not hasattr(assistant_model, "get_input_embeddings"):
            raise TypeError(
                f"assistant_model must be a gpuformers causal LM (e.g. AutoModelForCausalLM.from_pretrained(...)), "
                f"got {type(assistant_model).__name__}"
            )
        ours, theirs = model.config.vocab_size, assistant_model.config.vocab_size
        if theirs > ours:
            raise ValueError(
                f"assistant_model has vocab_size {theirs} but the model only {ours}: its drafts could name tokens "
                f"the model does not have; use an assistant that shares the model's tokenizer"
            )


def speculative_sampling(candidates: torch.Tensor, draft_scores: torch.Tensor,
                         target_scores: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Algorithm 1 of arXiv:2211.17192: candidates (k,) drawn from q = softmax(draft_scores) (k, vocab);
    target_scores (k + 1, vocab). Returns the accepted tokens plus one more ((n + 1,)) and n, the number of
    candidates accepted. The tokens are distributed as sampling from the target alone."""
    k = candidates.shape[0]
    p = F.softmax(target_scores, dim=-1)  # (k + 1, vocab)
    q = F.softmax(draft_scores, dim=-1)
    rows = torch.arange(k, device=p.device)
    ratio = p[rows, candidates] / q[rows, candidates]  # q > 0: the assistant drew these tokens
    accepted = torch.rand_like(ratio) <= ratio
    n = int((~accepted).cumsum(0).eq(0).sum())
    if n < k:
        # rejected: sample from the part of p that q under-covers
        residual = (p[n] - q[n]).clamp_min_(0)
        total = residual.sum()
        dist = residual / total if bool(total > torch.finfo(total.dtype).tiny) else p[n]
    else:
        dist = p[k]
    token = torch.multinomial(dist, num_samples=1)
    return torch.cat([candidates[:n], token]), n


def assisted_decoding(model, assistant_model, input_ids: torch.Tensor, step_inputs, config: GenerationConfig,
                      processors, criteria, streamer):
    """The assisted decode loop for one row (see the module docstring); called by generate() after
    check_assisted_generation, with its prepared config (max_length fixed), processors, criteria and the
    target's cache in step_inputs. Returns what generate() returns."""
    if assistant_model is not None:
        generator = AssistedCandidateGenerator(assistant_model, config, processors, step_inputs.positions,
                                               step_inputs.mask, model.config.vocab_size)
    else:
        generator = PromptLookupCandidateGenerator(config.prompt_lookup_num_tokens,
                                                   config.max_matching_ngram_size or 2, config.eos_token_ids)
    prompt_length = input_ids.shape[1]
    max_length = config.max_length
    cache = step_inputs.cache
    sequences = torch.empty(1, max_length, dtype=torch.long, device=input_ids.device)
    sequences[:, :prompt_length] = input_ids
    can_stop_early = bool(config.eos_token_ids or config.stop_strings or config.max_time is not None
                          or len(criteria) > count_length_criteria(criteria))
    scores_out = [] if config.return_dict_in_generate and config.output_scores else None
    logits_out = [] if config.return_dict_in_generate and config.output_logits else None
    if streamer is not None:
        streamer.put(input_ids.cpu())

    # a cache passed in may already hold the whole prompt: its last token is fed again for its logits
    cache.crop(min(cache.get_seq_length(), prompt_length - 1))
    length = prompt_length
    while length < max_length:
        # room for the candidates plus the target's own token
        candidates, draft_scores = generator.get_candidates(sequences, length, max_length - length - 1)
        k = candidates.shape[0]
        sequences[0, length:length + k] = candidates
        start, end = cache.get_seq_length(), length + k
        mask = step_inputs.mask
        if mask is not None and not step_inputs.full_mask:
            mask = mask[:, :end]
        outputs = model(input_ids=sequences[:, start:end], position_ids=step_inputs.positions[:, start:end],
                        attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=k + 1)
        logits = outputs.logits[0, -(k + 1):].float()  # (k + 1, vocab): the token after each prefix
        del outputs
        raw = logits.clone() if logits_out is not None and processors else logits  # a processor may work in place
        if processors:
            # position i continues sequences[:, :length + i]; for accepted positions that is the accepted text
            scores = torch.cat([processors(sequences[:, :length + i], logits[i:i + 1]) for i in range(k + 1)])
        else:
            scores = logits

        if config.do_sample and draft_scores is not None and k > 0:
            tokens, n = speculative_sampling(candidates, draft_scores, scores)
        else:
            if config.do_sample:
                chosen = torch.multinomial(F.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                chosen = greedy_tokens(scores)  # (k + 1,)
            n = int((candidates != chosen[:k]).cumsum(0).eq(0).sum())
            tokens = chosen[:n + 1]
        accepted = n + 1
        sequences[0, length:length + accepted] = tokens

        finished = False
        if can_stop_early:
            # each accepted token is checked as the plain loop would check it: eos inside the run ends it there
            done = torch.cat([criteria(sequences[:, :length + j + 1], scores[j:j + 1]) for j in range(accepted)])
            hit = done.nonzero()
            if len(hit):
                accepted, finished = int(hit[0]) + 1, True
        if streamer is not None:
            streamer.put(sequences[:, length:length + accepted].cpu())
        if scores_out is not None:
            scores_out.extend(scores[j:j + 1] for j in range(accepted))
        if logits_out is not None:
            logits_out.extend(raw[j:j + 1] for j in range(accepted))
        length += accepted
        cache.crop(length - 1)  # the newest token is fed in the next round
        generator.update_candidate_strategy(k, n)
        if finished:
            break

    generator.end()
    if streamer is not None:
        streamer.end()
    sequences = sequences[:, :length]
    if not config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(scores_out) if scores_out is not None else None,
        logits=tuple(logits_out) if logits_out is not None else None,
        past_key_values=cache,
    )
