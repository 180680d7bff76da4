"""preprocess_data's --split-sentences: documents split into sentences by NLTK's punkt model, as Megatron-LM's
tools/preprocess_data.py splits them (--lang, default english; --keep-newlines). The punkt model is NLTK's
tokenizers/punkt/LANG.pickle, looked up on NLTK's data path ($NLTK_DATA first), which NLTK 3.9 and later
read from its tokenizers/punkt_tab/LANG instead (they load no pickles). Megatron-LM names a file under
$NLTK_DATA itself, which those versions refuse; the lookup here finds the same model on either. Nothing is
downloaded: a missing package or model is one line naming what to install."""

from __future__ import annotations

import pickle
from collections.abc import Callable

# Megatron-LM splits text in slices of this many characters (punkt's cost grows with the text).
SLICE = 1_000_000


class SplitterUnavailable(Exception):
    """nltk or its punkt model is missing; the message is one line saying what to install."""


def _keep_newlines_vars(nltk):  # noqa: ANN001, ANN202 - nltk is imported late
    """punkt's language variables with the whitespace after a sentence end kept in that sentence (punkt's
    own pattern asks for whitespace before the next token and drops it, newlines included)."""

    class KeepWhitespace(nltk.tokenize.punkt.PunktLanguageVars):
        _period_context_fmt = r"""
            \S*                      # word material
            %(SentEndChars)s         # a possible sentence end
            \s*                      # the whitespace after it, kept in the sentence
            (?=(?P<after_tok>
                %(NonWord)s          # punctuation
                |
                (?P<next_tok>\S+)    # or the next token, its whitespace already consumed
            ))"""

    return KeepWhitespace()


def sentence_splitter(lang: str, keep_newlines: bool) -> Callable[[str], list[str]]:
    """A function from a document's text to its sentences."""
    try:
        import nltk
    except ImportError:
        raise SplitterUnavailable("--split-sentences needs the nltk package and its punkt model: pip install "
                                  "nltk, then python -m nltk.downloader punkt") from None
    try:
        punkt = nltk.load(f"nltk:tokenizers/punkt/{lang}.pickle")
    except (LookupError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise SplitterUnavailable(f"--split-sentences --lang {lang}: no punkt model for {lang} on NLTK's "
                                  f"data path ({type(err).__name__}); install it with python -m "
                                  "nltk.downloader punkt_tab (NLTK 3.9 and later) or punkt, or set NLTK_DATA "
                                  "to the directory that holds tokenizers/") from None
    if keep_newlines:
        punkt = nltk.tokenize.punkt.PunktSentenceTokenizer(train_text=punkt._params,
                                                           lang_vars=_keep_newlines_vars(nltk))

    def split(text: str) -> list[str]:
        return [sentence for start in range(0, len(text), SLICE)
                for sentence in punkt.tokenize(text[start:start + SLICE])]

    return split
