"""`deepseek_mtp` speculation's engine side (docs/speculative.md): the checkpoint's MTP layer drafts on the device
in each step (models/mtp.py mtp_propose, runner/spec_mtp.py), and the drafts come back with the step's tokens
(StepResult.mtp_drafts). `MTPProposer` keeps each request's latest drafts and hands them to the next plan."""

from __future__ import annotations


class MTPProposer:
    """Each request's drafts from the last step that sampled it, valid while the request holds the tokens it had
    when they were drafted (its next step then starts at the position they follow)."""

    def __init__(self) -> None:
        self._drafts: dict[str, tuple[int, list[int]]] = {}  # request id -> (num_tokens when drafted, drafts)

    def propose(self, engine) -> None:
        """Drafts for every running request that decodes next (one token to compute) and has no grammar."""
        for req in engine.scheduler.running:
            if req.grammar is None and req.num_tokens - req.num_computed_tokens == 1:
                drafts = self.latest(req)
                if drafts:
                    req.spec_token_ids = drafts

    def latest(self, req) -> list[int]:
        """The request's drafts where still valid (it holds the tokens it had when they were drafted), else []."""
        rec = self._drafts.get(req.request_id)
        return list(rec[1]) if rec is not None and rec[0] == req.num_tokens else []

    def record(self, engine, plan, result) -> None:
        """After the step's tokens are applied: keep the drafts of its sequences that sampled, forget finished
        requests' (and, now and then, those of requests no longer known, e.g. aborted)."""
        requests = engine.scheduler.requests
        for seq in plan.seqs:
            req = requests.get(seq.request_id)
            drafts = result.mtp_drafts.get(seq.request_id)
            if req is None or req.is_finished:
                self._drafts.pop(seq.request_id, None)
            elif drafts is not None:
                self._drafts[seq.request_id] = (req.num_tokens, drafts)
        if len(self._drafts) > 2 * len(requests) + 16:
            self._drafts = {rid: v for rid, v in self._drafts.items() if rid in requests}

    @staticmethod
    def pages(cfg, num_pages: int, how: str) -> tuple[int, str]:
        """Pages of a cache sized from memory for the target's L layers -> those that fit the same bytes with the
        MTP layer's latents as one more layer (L + 1), and the KV cache's log line `how` saying so."""
        n = max(2, num_pages * cfg.num_hidden_layers // (cfg.num_hidden_layers + 1))
        return n, f"{how}; {n} with the MTP layer's KV"

