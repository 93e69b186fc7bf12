"""Token-level stop decisions, made in the core after each appended token (DESIGN.md convention 3).

Stop strings need the detokenized text, so they are the output processor's job, not this one.
"""

from __future__ import annotations

from folio.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether ``request`` stops after its last output token; if so set its status (and stop_reason).

    In this order:
      1. a stop token, once num_output_tokens >= min_tokens -> FINISHED_STOPPED. ``all_stop_token_ids`` holds the
         user's ``stop_token_ids`` (stop_reason = that token id) and the model's EOS ids (stop_reason None; not a
         stop with ignore_eos). A stop token that is also the max_tokens-th token reports "stop", not "length".
      2. num_output_tokens >= request.max_tokens -> FINISHED_LENGTH_CAPPED.
      3. num_tokens >= max_model_len -> FINISHED_LENGTH_CAPPED: the next token would not fit the context.
    """
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens and last_token_id in params.all_stop_token_ids:
        if last_token_id in (params.stop_token_ids or ()):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
        if not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
            return True
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
