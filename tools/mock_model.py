"""The mock engine's prefill time for the Python analysis tools: Dynamo's
polynomial, as workers/kvw_mock_model.c computes it (its coefficients are
KVW_MOCK_PREFILL_* in workers/kvw_backend.h; keep the two in step)."""

SQUARE, PER_TOKEN, FIXED = 4.209989e-07, 1.518344e-02, 1.650142e+01


def prefill_ms(tokens):
    """One step computing `tokens` prompt tokens, in ms before --speedup."""
    if tokens <= 0:
        return 0.0
    return SQUARE * tokens * tokens + PER_TOKEN * tokens + FIXED
