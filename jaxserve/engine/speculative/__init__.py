"""Speculative decoding: draft tokens proposed on the host (``ngram``), verified in one call of
the decode weights over k + 1 positions (the ``verify`` programs), accepted by the lossless rule
(``verify``), rejected tokens' pages rolled back (``decoder``)."""
