"""Generated text for the encoder fine-tuning tasks: made here from word lists written in
this file and from ``num2words``, so nothing is downloaded and a seed gives the same data
on every machine (``random.Random``, whose sequence for a seed is fixed across Python 3
versions).

* language identification: a number written in words by ``num2words`` in one of several
  languages (``"vingt et un"`` -> fr); split by number, so no number of the test split is
  ever seen in training, in any language.
* tagged sentences (named entities): sentences from templates whose slots are people
  (PER), cities (CITY), dates (DATE: month and weekday names with numbers) and numbers
  (NUM: in digits or in words), with the character span of every entity.
* facts and questions (extractive QA): a context of three to five facts about two or
  three people ("Alice Martin was born in 1912. Bob lives in Lyon.") and a question about
  one of them ("Where does Bob live?") whose answer is a span of the context.

Sentences and contexts are distinct within a dataset and each lies in exactly one of
train, val and test. With ``held_out`` > 0 a fraction of the first names, surnames and
cities (drawn by the seed) never appears in training: val and test examples use only
those, so their scores measure what the model learned from context, not a memorised
list.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from attnlab.data.corpus import DataError

T = TypeVar("T")

FIRST_NAMES = (
    "Alice", "Bob", "Carol", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas",
    "Keiko", "Liam", "Maya", "Nora", "Omar", "Paula", "Quentin", "Rosa", "Samir", "Tara",
    "Ugo", "Vera", "Walter", "Xenia", "Yusuf", "Zoe", "Anton", "Beatriz", "Chen", "Dmitri",
    "Elena", "Felix", "Greta", "Hamid", "Ivy", "Jorge", "Kofi", "Lena", "Marco", "Nadia",
)  # fmt: skip
SURNAMES = (
    "Martin", "Smith", "Garcia", "Muller", "Rossi", "Novak", "Kowalski", "Silva", "Dubois",
    "Jensen", "Tanaka", "Okafor", "Haddad", "Larsen", "Moreau", "Costa", "Weber", "Petrov",
    "Fischer", "Nguyen", "Santos", "Keller", "Bianchi", "Lopez", "Schmidt",
)  # fmt: skip
CITIES = (
    "Paris", "Lyon", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Oslo",
    "Dublin", "Tokyo", "Lagos", "Cairo", "Lima", "Quito", "Seoul", "Hanoi", "Sydney",
    "Toronto", "Chicago", "Boston", "Denver", "Porto", "Milan", "Geneva", "Zurich",
    "New York", "Los Angeles", "Buenos Aires", "Rio de Janeiro", "Cape Town", "Hong Kong",
    "San Diego", "Mexico City", "Tel Aviv", "Kuala Lumpur",
)  # fmt: skip
# Month and weekday names are written here, not read from ``calendar``: its names follow
# the process locale, and the data must not.
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")  # fmt: skip
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
JOBS = ("teacher", "nurse", "baker", "pilot", "mechanic", "farmer", "lawyer", "painter",
        "doctor", "chef", "plumber", "writer", "dentist", "judge", "tailor", "barber")  # fmt: skip
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "grey",
           "pink", "brown", "teal")  # fmt: skip
INSTRUMENTS = ("piano", "violin", "guitar", "cello", "flute", "drums", "trumpet", "harp")

ENTITY_TYPES = ("PER", "CITY", "DATE", "NUM")  # the entity classes of tagged sentences


@dataclass(frozen=True)
class Fillers:
    """The people and cities that fill the templates' slots."""

    first_names: tuple[str, ...] = FIRST_NAMES
    surnames: tuple[str, ...] = SURNAMES
    cities: tuple[str, ...] = CITIES

    def split(self, held_out: float, seed: int) -> tuple[Fillers, Fillers]:
        """(seen, unseen): ``held_out`` of each list (at least 3 where > 0), drawn by
        ``seed``, goes to ``unseen``; the rest, never empty (DataError), stays ``seen``."""
        if not 0.0 <= held_out < 1.0:
            raise DataError(f"held_out must be in [0, 1), got {held_out}")
        rng = random.Random(seed)
        seen, unseen = {}, {}
        for name in ("first_names", "surnames", "cities"):
            values = list(getattr(self, name))
            rng.shuffle(values)
            k = max(3, round(held_out * len(values))) if held_out > 0 else 0
            if k >= len(values):
                raise DataError(
                    f"held_out={held_out} leaves none of the {len(values)} "
                    f"{name.replace('_', ' ')} for training; lower held_out"
                )
            seen[name], unseen[name] = tuple(values[k:]), tuple(values[:k])
        return Fillers(**seen), Fillers(**unseen)


EVERYONE = Fillers()  # every name and city


@dataclass(frozen=True)
class Splits(Generic[T]):
    """Examples cut into train, val and test (disjoint)."""

    train: list[T]
    val: list[T]
    test: list[T]

    def split(self, name: str) -> list[T]:
        """The examples of split ``name`` (train, val or test)."""
        if name not in ("train", "val", "test"):
            raise DataError(f"unknown split {name!r}; choose train, val or test")
        return getattr(self, name)


def _check_sizes(n_train: int, n_val: int, n_test: int) -> None:
    if n_train < 1 or n_val < 0 or n_test < 0:
        raise DataError(f"need n_train >= 1, n_val >= 0, n_test >= 0, got {n_train, n_val, n_test}")


def distinct_splits(
    make: Callable[[random.Random], T],
    key: Callable[[T], str],
    n_train: int,
    n_val: int,
    n_test: int,
    seed: int,
    make_eval: Callable[[random.Random], T] | None = None,
) -> Splits[T]:
    """Draw ``n_train`` examples with ``make(rng)``, then ``n_val + n_test`` with
    ``make_eval`` (default ``make``), dropping any whose ``key`` was drawn before, and cut
    them in drawing order: no key lies in two splits. DataError when the templates cannot
    give that many distinct examples."""
    _check_sizes(n_train, n_val, n_test)
    rng = random.Random(seed)
    seen: set[str] = set()
    examples: list[T] = []
    for maker, total in ((make, n_train), (make_eval or make, n_train + n_val + n_test)):
        tries = 0
        while len(examples) < total:
            tries += 1
            if tries > 20 * total + 1000:
                raise DataError(
                    f"only {len(examples)} distinct examples after {tries} draws; ask for "
                    "fewer (n_train + n_val + n_test) or hold out more names (held_out)"
                )
            example = maker(rng)
            if key(example) not in seen:
                seen.add(key(example))
                examples.append(example)
    return Splits(
        examples[:n_train], examples[n_train : n_train + n_val], examples[n_train + n_val :]
    )


# --------------------------------------------------------------------------- language id


def number_languages(
    langs: tuple[str, ...] | list[str],
    *,
    max_number: int,
    n_train: int,
    n_val: int,
    n_test: int,
    seed: int = 0,
) -> Splits[tuple[str, int]]:
    """(words, language index) pairs: the numbers in ``[0, max_number)`` drawn by a
    permutation seeded with ``seed`` are cut into train / val / test *numbers*, and each
    number is written in every language of ``langs``. A text that two languages (or two
    numbers) share, like "six" in English and French, is ambiguous and left out."""
    from attnlab.data.numbers import check_language, number_to_words

    if len(langs) < 2 or len(set(langs)) != len(langs):
        raise DataError(f"need at least two distinct languages, got {list(langs)}")
    for lang in langs:
        check_language(lang)
    _check_sizes(n_train, n_val, n_test)
    total = n_train + n_val + n_test
    if total > max_number:
        raise DataError(
            f"n_train + n_val + n_test = {total} numbers exceed max_number={max_number}"
        )
    order = random.Random(seed).sample(range(max_number), total)
    texts = [[(number_to_words(n, lang), i) for i, lang in enumerate(langs)] for n in order]
    count: dict[str, int] = {}
    for row in texts:
        for text, _ in row:
            count[text] = count.get(text, 0) + 1

    def cut(rows: list[list[tuple[str, int]]]) -> list[tuple[str, int]]:
        return [(text, label) for row in rows for text, label in row if count[text] == 1]

    return Splits(
        cut(texts[:n_train]), cut(texts[n_train : n_train + n_val]), cut(texts[n_train + n_val :])
    )


# --------------------------------------------------------------------------- named entities


@dataclass(frozen=True)
class Entity:
    """A labelled character span ``text[start:end]``."""

    start: int
    end: int
    label: str


@dataclass(frozen=True)
class TaggedSentence:
    """A sentence and its entities (sorted, not overlapping)."""

    text: str
    entities: tuple[Entity, ...]

    def spans(self) -> list[tuple[str, str]]:
        """(label, text) of every entity, in order."""
        return [(e.label, self.text[e.start : e.end]) for e in self.entities]


NER_TEMPLATES = (
    "{PER} moved to {CITY} on {DATE}.",
    "On {DATE}, {PER} met {PER} in {CITY}.",
    "{PER} bought {NUM} tickets to {CITY}.",
    "The train from {CITY} to {CITY} left on {DATE} with {NUM} passengers.",
    "{PER} was born in {CITY} on {DATE}.",
    "{NUM} people visited {PER} in {CITY}.",
    "{PER} and {PER} will arrive on {DATE}.",
    "In {CITY}, {PER} sold {NUM} paintings.",
    "{PER} called from {CITY}.",
    "The meeting with {PER} is on {DATE}.",
    "{PER} has lived in {CITY} for {NUM} years.",
    "We flew to {CITY} on {DATE} and stayed {NUM} nights.",
)


def _person(rng: random.Random, fillers: Fillers) -> str:
    first = rng.choice(fillers.first_names)
    return f"{first} {rng.choice(fillers.surnames)}" if rng.random() < 0.5 else first


def _date(rng: random.Random, fillers: Fillers) -> str:
    month, day, year = rng.choice(MONTHS), rng.randint(1, 28), rng.randint(1950, 2030)
    forms = (
        f"{month} {day}",
        f"{day} {month} {year}",
        f"{month} {day}, {year}",
        f"{rng.choice(WEEKDAYS)}, {month} {day}",
        f"{rng.choice(WEEKDAYS)}",
    )
    return rng.choice(forms)


def _number(rng: random.Random, fillers: Fillers) -> str:
    n = rng.choice((rng.randint(2, 20), rng.randint(21, 999), rng.randint(1000, 20000)))
    if n < 1000 and rng.random() < 0.5:  # in words ("three hundred and twelve")
        from attnlab.data.numbers import number_to_words

        return number_to_words(n)
    return f"{n:,}" if rng.random() < 0.5 else str(n)


ENTITY_MAKERS: dict[str, Callable[[random.Random, Fillers], str]] = {
    "PER": _person,
    "CITY": lambda rng, fillers: rng.choice(fillers.cities),
    "DATE": _date,
    "NUM": _number,
}


def tagged_sentence(rng: random.Random, fillers: Fillers = EVERYONE) -> TaggedSentence:
    """One sentence from a random template, its slots filled (people and cities from
    ``fillers``); the entities are the slots."""
    template = rng.choice(NER_TEMPLATES)
    text, entities = "", []
    rest = template
    while "{" in rest:
        before, _, after = rest.partition("{")
        label, _, rest = after.partition("}")
        text += before
        value = ENTITY_MAKERS[label](rng, fillers)
        entities.append(Entity(len(text), len(text) + len(value), label))
        text += value
    text += rest
    return TaggedSentence(text[0].upper() + text[1:], tuple(entities))


def tagged_sentences(
    n_train: int, n_val: int, n_test: int, seed: int = 0, held_out: float = 0.0
) -> Splits[TaggedSentence]:
    """Distinct generated sentences with their entities, cut into train / val / test;
    val and test people and cities are the ``held_out`` fraction (see the module)."""
    seen, unseen = EVERYONE.split(held_out, seed)
    return distinct_splits(
        lambda rng: tagged_sentence(rng, seen),
        lambda s: s.text,
        n_train,
        n_val,
        n_test,
        seed,
        make_eval=(lambda rng: tagged_sentence(rng, unseen)) if held_out else None,
    )


# --------------------------------------------------------------------------- question answering


@dataclass(frozen=True)
class QAExample:
    """A context, a question, and the answer: ``context[start:start + len(answer)]``."""

    context: str
    question: str
    answer: str
    start: int

    @property
    def end(self) -> int:
        """One past the answer's last character in the context."""
        return self.start + len(self.answer)


# relation -> (fact template, question template, value maker); {P} is the person, {V} the
# value, which is the answer.
RELATIONS: dict[str, tuple[str, str, Callable[[random.Random, Fillers], str]]] = {
    "born": (
        "{P} was born in {V}.",
        "When was {P} born?",
        lambda r, f: str(r.randint(1900, 2020)),
    ),  # fmt: skip
    "lives": ("{P} lives in {V}.", "Where does {P} live?", lambda r, f: r.choice(f.cities)),
    "job": ("{P} works as a {V}.", "What is the job of {P}?", lambda r, f: r.choice(JOBS)),
    "colour": (
        "The favourite colour of {P} is {V}.",
        "What colour does {P} like best?",
        lambda r, f: r.choice(COLOURS),
    ),  # fmt: skip
    "plays": (
        "{P} plays the {V}.",
        "Which instrument does {P} play?",
        lambda r, f: r.choice(INSTRUMENTS),
    ),  # fmt: skip
    "cats": (
        "{P} has {V} cats.",
        "How many cats does {P} have?",
        lambda r, f: str(r.randint(2, 9)),
    ),  # fmt: skip
}


def qa_example(rng: random.Random, fillers: Fillers = EVERYONE) -> QAExample:
    """Two or three people, three to five facts about them (no person-relation pair twice),
    shuffled into a context; the question asks one of the facts. People and cities come
    from ``fillers``."""
    people = rng.sample(fillers.first_names, rng.randint(2, 3))
    pairs = [(p, rel) for p in people for rel in RELATIONS]
    facts = rng.sample(pairs, rng.randint(3, 5))
    asked = rng.randrange(len(facts))
    context, answer, start = "", "", -1
    for i, (person, relation) in enumerate(facts):
        fact, _, make = RELATIONS[relation]
        value = make(rng, fillers)
        head, _, tail = fact.format(P=person, V="\0").partition("\0")
        if i == asked:
            answer, start = value, len(context) + (1 if context else 0) + len(head)
        context += (" " if context else "") + head + value + tail
    person, relation = facts[asked]
    question = RELATIONS[relation][1].format(P=person)
    return QAExample(context, question, answer, start)


def qa_examples(
    n_train: int, n_val: int, n_test: int, seed: int = 0, held_out: float = 0.0
) -> Splits[QAExample]:
    """Distinct generated contexts (one question each), cut into train / val / test;
    val and test people and cities are the ``held_out`` fraction (see the module)."""
    seen, unseen = EVERYONE.split(held_out, seed)
    if len(seen.first_names) < 3:  # a context names up to three people
        raise DataError(
            f"held_out={held_out} leaves {len(seen.first_names)} first names for training, "
            "fewer than the 3 a context may name; lower held_out"
        )
    return distinct_splits(
        lambda rng: qa_example(rng, seen),
        lambda e: e.context,
        n_train,
        n_val,
        n_test,
        seed,
        make_eval=(lambda rng: qa_example(rng, unseen)) if held_out else None,
    )
