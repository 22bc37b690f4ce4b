"""Answer-side check for prompt injection: an answer that repeats an instruction, active markup or a
web address found in the passages the model read is flagged.

Why at the answer as well as at ingest: the ingest sanitiser (retrieval/sanitize.py) removes the
instruction-like text it recognises, but no pattern list is complete (paraphrases, other languages,
look-alike letters, an index built by an older version), and it must not remove ordinary clinical
sentences. A model that obeyed a passage shows it in its answer: it repeats the passage's command or
the words the command asked for, writes the link the passage asked for, or echoes its markup. This
check compares the finished answer with the passages that were in its prompt, so it catches what
ingest missed whatever the wording. It warns and never edits: the answer is still shown, as inert
text in which no link or markup is live.

    finding = check_answer(answer, passages, question=question)   # None, or an InjectionFinding
    if finding: show(finding.warning)

Because it only warns, its instruction patterns are broader than the sanitiser's. It is called by
the UI layer (medvqa/ui/handlers.py) and the CLI (medvqa/__main__.py) once an answer is complete.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from .safe_text import inert
from .textfold import fold, fold_case

SHINGLE_WORDS = 3  # an answer sharing this many consecutive words with a passage's instruction repeats it

# Commands addressed to a model, matched on fold() (Latin letters, no accents, lower case).
_ENGLISH = [
    r"\b(?:ignore|disregard|forget|override|bypass|skip|drop|abandon)\b.{0,60}?\b(?:instructions?|prompts?|rules|"
    r"directions|guidelines|guidance|guardrails|context|polic(?:y|ies)|told|above)\b",
    r"\b(?:set aside|pay no (?:attention|heed)|no longer follow|stop following|do not follow|don'?t follow)\b",
    r"\b(?:whatever|what|everything|anything) (?:you were|you've been|you have been|you are) "
    r"(?:told|given|instructed)\b",
    r"\b(?:new|updated|real|actual|hidden|secret|true) (?:instructions?|system prompt)\b",
    r"\b(?:new|updated|real|actual|hidden|secret) task\s*[:\-]",
    r"\byour (?:real|actual|true|new|only|primary) (?:job|task|role|goal|purpose|instructions?)\b",
    r"\b(?:system prompt|jailbreak|prompt injection|developer mode)\b",
    r"\byou (?:are now|are no longer|are actually|must now|must always|must never|will now|should now|shall)\b",
    r"\bfrom now on\b",
    r"\b(?:pretend|act) (?:to be|as if|that you|like you)\b",
    r"\b(?:note|message|instructions?|directive|reminder) (?:to|for) (?:the |any |all )?(?:ai|assistant|model|"
    r"language model|llm|chatbot|bot|reader|system)\b",
    r"\b(?:ai|assistant|language model|llm|chatbot|model) (?:reading|processing|summari[sz]ing|answering)\b",
    r"\bas (?:an|the) (?:ai|assistant|language model|model)\b",
    r"\b(?:the|any) (?:ai|assistant|model|chatbot|llm) (?:must|should|shall|will|needs to|has to|is required)\b",
    r"^(?:(?:user|human|system|assistant)\s*:?\s*)?(?:(?:please|kindly|now|always|just|simply|instead|then|also),? )*"
    r"(?:reply|respond|say|write|output|print|"
    r"tell|inform|conclude|claim|insist|include|append|mention|recommend|repeat|translate|visit|click|navigate|"
    r"download|forward|email) ",
    r"\btell (?:the |your )?(?:user|patient|clinician|doctor|physician|radiologist|reader|human)\b",
    r"\b(?:in|at the end of|at the start of) (?:your|every|each|all|any) "
    r"(?:answers?|repl(?:y|ies)|responses?|outputs?)\b",
    r"\b(?:every|each|all) (?:answers?|repl(?:y|ies)|responses?)\b.{0,30}\b(?:must|should|end with|start with|"
    r"begin with|include)\b",
    r"\b(?:regardless of|no matter) (?:the |what the )?(?:image|scan|question|findings?|evidence|context)\b",
    r"\b(?:reply|answer|say|output)\b.{0,20}\b(?:only|exactly|verbatim|nothing but|just)\b",
    r"\bit (?:would be|is|will be) (?:most |very |really |especially |extremely )?(?:helpful|important|essential|"
    r"best|useful|vital) (?:if|that) (?:you|any|every|each|the|your)\b",
    r"\b(?:any|every|each|your|the) (?:summary|summaries|answers?|repl(?:y|ies)|responses?|outputs?)\b.{0,40}?\b"
    r"(?:should|must|shall|mention(?:s|ed)?|says?|states?|include[sd]?|notes?)\b",
    r"\bdo not (?:mention|cite|reveal|tell|disclose|say)\b",
    # Orders to whoever reads or answers, in the words a paraphrase uses (scripts/redteam.py's, and an audit's).
    r"\b(?:always|never) (?:answer|reply|respond|say|state|call|report|conclude|describe|diagnose)\b",
    r"\bwhen(?:ever)? (?:asked|questioned|queried)\b",
    r"\b(?:whoever|anyone|anybody|everyone|readers?) (?:who )?(?:answers?|answering|summari[sz](?:es|ing)|reads?|"
    r"reading|describes?|describing|reports?|reporting)\b.{0,60}?\b(?:must|should|shall|has to|have to|needs? to)\b",
    r"\b(?:make sure|ensure|see to it) (?:that )?(?:the|any|every|each|your) (?:summary|summaries|answers?|"
    r"repl(?:y|ies)|responses?|reports?)\b",
    r"^(?:(?:please|kindly|now|always|just|simply|instead|then|also),? )*(?:state|call|answer|describe|report|"
    r"diagnose|label) (?:that|it|this|the)\b",
]
# The same commands in other languages, matched on fold_case() (the passage's own script kept).
_OTHER_LANGUAGES = [
    r"\bignore[zr]?\b.{0,50}\b(?:instructions?|consignes)\b", r"\boublie[zr]?\b.{0,50}\b(?:instructions?|consignes)\b",
    r"\br[ée]pond(?:ez|s|re)?\b.{0,15}\b(?:que|uniquement|seulement)\b", r"\bdites?\b.{0,10}\bque\b",
    r"\bignorier(?:e|en|t)?\b", r"\bvergiss\b", r"\b(?:anweisungen|instruktionen)\b",
    r"\bantworte(?:n|t)?\b.{0,20}\b(?:nur|immer|ausschlie(?:ß|ss)lich|mit|dass)\b",
    r"\bsag(?:e|en|t)?\b.{0,15}\bdass\b",
    r"\b(?:ignora|ignore|olvida|olvide|omite)\b.{0,50}\binstrucciones\b",
    r"\bresponde\b.{0,15}\b(?:que|solo|únicamente)\b",
    r"\bdi(?:ga)? que\b", r"\bignora\b.{0,50}\bistruzioni\b", r"\brispondi\b.{0,15}\b(?:che|solo)\b",
    r"\bignore\b.{0,50}\binstruções\b", r"\bresponda\b.{0,15}\b(?:que|apenas|somente)\b",
    r"игнорир", r"забудь", r"инструкци", r"ответь\w*\s+(?:что|только)", r"скажи\w*\s+что",
    r"忽略", r"无视", r"忘记", r"指令", r"只回答", r"仅回答", r"请回答", r"回答[:：]", r"無視", r"指示", r"とだけ",
    r"무시", r"지시",
]
# Markup and prompt delimiters: active content in a page, or a forged turn of the conversation.
_MARKUP = [
    r"<[a-z][\w:-]*[^<>]*[\s/\"']on[a-z]+\s*=", r"<\s*/?\s*(?:script|iframe|object|embed|svg|math|details|img|form|"
    r"base|meta|link|style|video|audio|body|input)\b", r"\bjavascript\s*:", r"\bdata\s*:\s*text/html",
    r"!?\[[^\]\n]{0,200}\]\(\s*<?(?:[a-z][a-z0-9+.-]*:|/|#|www\.)", r"\]\[[^\]\n]{0,40}\]",
    r"^\s*\[[^\]\n]{1,80}\]:\s*<?(?:https?:|www\.|/)",
    r"<\|[^|<>]{0,40}\|>", r"\[/?inst\]", r"<<\s*/?sys\s*>>", r"</?\s*(?:source|system|user|assistant|human|"
    r"start_of_turn|end_of_turn|s|im_start|im_end|eos|bos)\b[^<>]{0,40}>",
    r"#{2,}\s*(?:instruction|system|response|human|assistant|user)\b",
    r"^\s*(?:human|assistant|system|user|developer)\s*:",
]
_ENGLISH_RE = re.compile("|".join(f"(?:{p})" for p in _ENGLISH), re.MULTILINE)
_OTHER_RE = re.compile("|".join(f"(?:{p})" for p in _OTHER_LANGUAGES))
_MARKUP_RE = re.compile("|".join(f"(?:{p})" for p in _MARKUP), re.MULTILINE)

_SENTENCE = re.compile(r"(?<=[.!?;])\s+|(?<=[。！？；])|\n+")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_WORD = re.compile(r"\w+")
_QUOTED = re.compile(r"(?:^|(?<=[\s:(]))[\"“”«»「『'‘]([^\"“”«»」』\n]{3,120}?)[\"“”«»」』'’](?=[\s.,;:!?)]|$)")
_AFTER_COLON = re.compile(r"[:：]\s*([^:：\n]{3,160})$")
_STOPWORDS = set("a an the and or of to in on at for with that this is are was were be been it its as by from "
                 "your you any all every each only just not no do does".split())

# Web addresses, after undoing the usual obfuscations (hxxp, [.], (dot)).
_DEOBFUSCATE = [(re.compile(r"\bhxxp"), "http"), (re.compile(r"\s*[\[({<]\s*(?:\.|dot)\s*[\])}>]\s*"), "."),
                (re.compile(r"\s+dot\s+"), "."), (re.compile(r"\[:\]"), ":"), (re.compile(r"\s*\[/\]\s*"), "/")]
_URL = re.compile(r"\b(?:https?://|www\.)[^\s<>\"'`)\]]+")
_DOMAIN = re.compile(r"\b((?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+([a-z]{2,24}))\b(?![.-]?\w)")
_GENERIC_TLDS = set("com org net edu gov mil int info biz io co app dev site online xyz top club shop store tech "
                    "ai me ly to tk ml ga cf gq cc tv ws pw link click live news example test invalid local "
                    "health care clinic doctor med".split())


@dataclass(frozen=True)
class InjectionFinding:
    """What an answer repeated from its passages: `kinds` ("instruction", "markup", "link") and short
    quotes of the repeated passage text (as it was folded for comparison)."""

    kinds: tuple[str, ...]
    repeated: tuple[str, ...]

    @property
    def warning(self) -> str:
        """The plain-words warning shown next to the answer and written into the transcript."""
        what = {"instruction": "an instruction", "markup": "markup (code or a link)",
                "link": "a web address that is not one of its cited sources"}
        found = " and ".join(what[kind] for kind in self.kinds)
        return (f"Caution: this answer repeats {found} found in a retrieved passage. The passage may be trying "
                f"to steer the model: do not follow it or open the address, and check the answer against the "
                f"image and the sources.")

    def record(self) -> dict:
        """For the transcript: the warning, the kinds, and the repeated text made inert."""
        return {"warning": self.warning, "kinds": list(self.kinds), "repeated": [inert(r) for r in self.repeated]}


def check_answer(answer: str, passages: Sequence, citation_urls: Iterable[str] = (),
                 question: str = "") -> InjectionFinding | None:
    """Flag `answer` when it repeats an instruction, markup or a web address from `passages` (objects
    with `.text` and `.url`). A web address is exempt when it belongs to a passage's own URL or to one of
    `citation_urls`, the links the app itself shows. Words the `question` asked about are expected in
    an answer: a run of words counts as repeated only with a meaningful word the question lacks (an
    answer to "How old is this haematoma?" may say "the haematoma is" whatever a passage says). None
    when nothing was repeated."""
    texts = [str(getattr(p, "text", "") or "") for p in passages]
    if not answer or not answer.strip() or not any(texts):
        return None
    folded_answer = fold(answer)
    answer_tokens = _tokens(folded_answer)
    answer_shingles = _shingles(answer_tokens, asked=frozenset(_tokens(fold(question))))
    kinds: list[str] = []
    repeated: list[str] = []
    for sentence, following in _sentences(texts):
        kind = instruction_kind(sentence)
        if kind is None:
            continue
        # A command often runs on past a full stop ('... the sentence "Contact Dr. Mallory ..."'): what
        # the answer is compared with is the command and the sentence after it.
        folded = fold(sentence + " " + following)
        evidence = _repeated_part(folded, answer_shingles, answer_tokens, folded_answer)
        if evidence is None and kind == "markup":
            evidence = _same_markup(folded, folded_answer)
        if evidence is not None:
            _add(kinds, kind)
            repeated.append(evidence)
    exempt = {_host(url) for url in (*[getattr(p, "url", "") for p in passages], *citation_urls)} - {""}
    leaked = sorted((_addresses("\n".join(texts)) - exempt) & _addresses(answer))
    if leaked:
        _add(kinds, "link")
        repeated.extend(leaked)
    if not kinds:
        return None
    order = ("instruction", "markup", "link")
    return InjectionFinding(tuple(sorted(kinds, key=order.index)), tuple(dict.fromkeys(repeated))[:5])


def _sentences(texts: list[str]) -> list[tuple[str, str]]:
    """Each sentence of the passages with the sentence after it in the same passage ("" at the end)."""
    pairs = []
    for text in texts:
        sentences = [s for s in _SENTENCE.split(text) if s and s.strip()]
        pairs += list(zip(sentences, [*sentences[1:], ""]))
    return pairs


def instruction_kind(sentence: str) -> str | None:
    """"instruction" when `sentence` reads as a command to a model, "markup" when it holds active
    markup or a prompt delimiter, else None. Broader than the ingest sanitiser: it only decides what an
    answer is compared with."""
    folded = fold(sentence)
    if _MARKUP_RE.search(folded) or _MARKUP_RE.search(sentence.casefold()):
        return "markup"
    if _ENGLISH_RE.search(folded) or _OTHER_RE.search(fold_case(sentence)) or _OTHER_RE.search(folded):
        return "instruction"
    from .retrieval.sanitize import is_instruction_like  # what ingest neutralises counts too (an old index)

    return "instruction" if is_instruction_like(folded) else None


def _repeated_part(sentence: str, answer_shingles: set, answer_tokens: list[str], answer: str) -> str | None:
    """The part of an instruction sentence the answer repeats: a run of SHINGLE_WORDS words, a quoted
    phrase, or the words after its colon (what "reply: ..." asks for)."""
    tokens = _tokens(sentence)
    for shingle in _shingles(tokens):
        if shingle in answer_shingles:
            return " ".join(shingle)
    payloads = [m.group(1) for m in _QUOTED.finditer(sentence)]
    colon = _AFTER_COLON.search(sentence)
    if colon:
        payloads.append(colon.group(1))
    for payload in payloads:
        words = _tokens(payload)
        if words and any(len(w) >= 3 or _CJK.match(w) for w in words) and _contains(answer_tokens, words):
            return payload.strip()
    return None


def _same_markup(sentence: str, answer: str) -> str | None:
    """Markup of the sentence that the answer holds too (an echoed tag, delimiter or link syntax)."""
    for pattern in _MARKUP:
        regex = re.compile(pattern, re.MULTILINE)
        found = regex.search(sentence)
        if found and regex.search(answer):
            return found.group(0)
    return None


def _tokens(text: str) -> list[str]:
    """Words; a run of CJK characters counts one word a character (those scripts use no spaces)."""
    out: list[str] = []
    for word in _WORD.findall(text):
        out.extend(list(word) if _CJK.search(word) else [word])
    return out


def _shingles(tokens: list[str], asked: frozenset[str] = frozenset()) -> set[tuple[str, ...]]:
    """Runs of SHINGLE_WORDS tokens with at least one that carries meaning (not short, common or one
    of the question's own words)."""
    return {tuple(tokens[i:i + SHINGLE_WORDS]) for i in range(len(tokens) - SHINGLE_WORDS + 1)
            if any(((len(t) >= 4 and t not in _STOPWORDS) or _CJK.match(t)) and t not in asked
                   for t in tokens[i:i + SHINGLE_WORDS])}


def _contains(tokens: list[str], run: list[str]) -> bool:
    return any(tokens[i:i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


def _addresses(text: str) -> set[str]:
    """Host names of the web addresses in `text`: full URLs, www. names and bare domain names."""
    folded = fold(text)
    for pattern, replacement in _DEOBFUSCATE:
        folded = pattern.sub(replacement, folded)
    hosts = {_host(url if "://" in url else "http://" + url) for url in _URL.findall(folded)}
    for match in _DOMAIN.finditer(folded):
        labels = match.group(1).split(".")
        if len(match.group(2)) == 2 or match.group(2) in _GENERIC_TLDS:
            if not all(label.isdigit() for label in labels):
                hosts.add(match.group(1))
    return {h.removeprefix("www.") for h in hosts if h and "." in h}


def _host(url: str) -> str:
    try:
        return (urlsplit(fold(str(url or ""))).hostname or "").removeprefix("www.")
    except ValueError:
        return ""


def _add(kinds: list[str], kind: str) -> None:
    if kind not in kinds:
        kinds.append(kind)
