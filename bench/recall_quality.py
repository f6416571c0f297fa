"""Recall quality of the embedded store: does a paraphrased question find the fact it asks about?

``python -m bench.recall_quality`` stores 60 facts of the kind people tell an assistant, each
with a distractor that shares words with the fact's question without answering it, then asks
each fact's question, which is phrased in other words than the fact ("My daughter Mia is
allergic to peanuts." / "Does my kid have any food allergy?"). It prints recall@1 and recall@3
for the ``lexical`` and the ``hybrid`` ranking and writes them to
``bench/results/recall_quality.md``. Two more sets: questions that repeat a fact's rare word
("Who is Priya?"), which ``hybrid`` must still answer first, and Chinese and Japanese facts
asked about with a word they share. Every node has the same age, so recency does not decide.
The paraphrased questions are also asked of a store of the 60 facts alone, said one after
another without their distractors ("facts alone @1": a fact's neighbours are other facts).

The ``hybrid`` rows need the ``semantic`` extra; without it they are reported as not run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from arona_store.base import StoreBase
from arona_store.ranking import Ranking, semantic_available
from arona_store.store import MemoryStore, NewNode

RESULTS = Path(__file__).parent / "results" / "recall_quality.md"
NOW = 1_780_000_000.0
AGE_S = 3 * 3600.0

# (fact, paraphrased question, distractor sharing the question's words)
ITEMS: tuple[tuple[str, str, str], ...] = (
    (
        "My daughter Mia is allergic to peanuts.",
        "Does my kid have any food allergy?",
        "I cooked food for my kid's birthday party.",
    ),
    (
        "I work as a nurse at St. Mary's hospital.",
        "What is my job?",
        "My job interview went well last week.",
    ),
    (
        "My wife Anna's birthday is on March 3rd.",
        "When does my spouse celebrate turning a year older?",
        "We celebrate Christmas with my spouse's family.",
    ),
    (
        "I drive a blue 2015 Honda Civic.",
        "What car do I own?",
        "The car wash near my office is closed on Sundays.",
    ),
    (
        "I'm vegetarian and never eat meat.",
        "What diet do I follow?",
        "My doctor said I should follow a strict sleep schedule.",
    ),
    (
        "My dog Rex is a golden retriever.",
        "What breed is my pet?",
        "My pet peeve is people chewing loudly.",
    ),
    ("I live in Lyon, France.", "Which city is my home?", "I work from home on Fridays."),
    (
        "I'm learning to play the cello.",
        "Which musical instrument am I studying?",
        "I'm studying for my accounting exam.",
    ),
    (
        "My favorite movie is Spirited Away.",
        "Which film do I like best?",
        "We watched a film about sharks last night.",
    ),
    (
        "I have type 1 diabetes and take insulin daily.",
        "Do I have any chronic medical condition?",
        "The medical center changed its opening hours.",
    ),
    (
        "My son Leo goes to Lincoln Elementary.",
        "Which school does my boy attend?",
        "I can't attend the school board meeting on Tuesday.",
    ),
    ("I'm afraid of heights.", "What phobia do I have?", "My sister has a phobia of spiders."),
    (
        "I usually wake up at 5:30 am to go running.",
        "What time do I get out of bed?",
        "I bought a new bed frame last month.",
    ),
    ("My mother lives in Osaka.", "Where is my mom based?", "My mom loves gardening."),
    (
        "I'm allergic to cats, they make me sneeze.",
        "Which animals should I avoid because of my allergy?",
        "Zoo animals look sad in small cages.",
    ),
    (
        "I studied computer science at the University of Toronto.",
        "Where did I go to college?",
        "My niece starts college in September.",
    ),
    (
        "My favorite food is ramen.",
        "What dish do I enjoy eating most?",
        "I enjoy eating outside when the weather is nice.",
    ),
    (
        "I speak Spanish and Portuguese fluently.",
        "What languages do I know?",
        "Programming languages like Rust are hard to learn.",
    ),
    (
        "My husband Tom is a firefighter.",
        "What does my partner do for a living?",
        "My business partner is moving to Berlin.",
    ),
    (
        "I take the 7:40 train to work every morning.",
        "How do I commute?",
        "The commute home was long because of the snow.",
    ),
    (
        "I don't drink alcohol.",
        "Should I order wine or beer for myself?",
        "We need to order more beer for the party.",
    ),
    (
        "I'm training for the Berlin marathon in September.",
        "What race am I preparing for?",
        "I'm preparing a presentation for Monday.",
    ),
    (
        "My blood type is O negative.",
        "Which transfusion group am I?",
        "I joined a new book group this month.",
    ),
    (
        "I've been married for twelve years.",
        "How long ago was my wedding?",
        "The wedding cake was delicious.",
    ),
    (
        "My laptop is a ThinkPad X1 Carbon.",
        "What computer do I use?",
        "The computer lab at the library closes at 8.",
    ),
    (
        "I hate cilantro, it tastes like soap to me.",
        "Which herb do I dislike?",
        "I planted an herb garden on the balcony.",
    ),
    (
        "My grandfather fought in Korea.",
        "Was any of my relatives a soldier?",
        "My relatives are visiting for Thanksgiving.",
    ),
    (
        "I'm colorblind and can't tell red from green.",
        "Do I have trouble seeing some colors?",
        "I love the colors of autumn leaves.",
    ),
    (
        "My rent is 1,800 dollars a month.",
        "How much do I pay for my apartment?",
        "I need to pay the electricity bill.",
    ),
    (
        "I play chess online every evening.",
        "What board game is my hobby?",
        "The board meeting was moved to Thursday.",
    ),
    ("I'm pregnant, due in June.", "Am I expecting a baby?", "My neighbor's baby cries at night."),
    (
        "I have two cats named Salt and Pepper.",
        "How many pets do I have?",
        "Pets are not allowed in my office.",
    ),
    (
        "I'm a night owl and do my best work after midnight.",
        "When am I most productive?",
        "Productive meetings need a clear agenda.",
    ),
    (
        "My car insurance is with Allianz.",
        "Which company covers my vehicle?",
        "My company offers free lunch on Fridays.",
    ),
    (
        "I broke my left wrist skiing last winter.",
        "Have I had any injuries?",
        "Sports injuries are common in teenagers.",
    ),
    (
        "My favorite color is teal.",
        "Which shade do I like most?",
        "The lamp shade in the living room is torn.",
    ),
    (
        "I meditate for twenty minutes each morning.",
        "Do I have a mindfulness practice?",
        "Piano practice is on Wednesdays.",
    ),
    (
        "My best friend is called Priya.",
        "Who is my closest buddy?",
        "My buddy from the gym moved away.",
    ),
    ("I'm lactose intolerant.", "Can I have milk in my coffee?", "Coffee prices went up again."),
    (
        "I volunteer at the animal shelter on Saturdays.",
        "What charity work do I do on weekends?",
        "Weekends are for sleeping in.",
    ),
    ("I was born in 1988.", "How old am I?", "The old bridge is being repaired."),
    (
        "My sister Clara lives in Melbourne.",
        "Which country is my sibling in?",
        "My sibling and I share a streaming account.",
    ),
    (
        "I'm saving money to buy a house next year.",
        "What is my financial goal?",
        "My fitness goal is to run 5k.",
    ),
    (
        "I wear contact lenses because I'm nearsighted.",
        "Is my eyesight good?",
        "Good restaurants are hard to find here.",
    ),
    ("My father passed away in 2019.", "Is my dad still alive?", "My dad jokes are terrible."),
    (
        "I prefer tea over coffee in the morning.",
        "What hot drink do I like to start the day with?",
        "Drink more water on hot days.",
    ),
    (
        "I'm a big fan of the Boston Celtics.",
        "Which basketball team do I support?",
        "The team lunch is on Friday.",
    ),
    (
        "I keep my spare house key under the flower pot.",
        "How do I get into my home if I'm locked out?",
        "I got a new chair for my home office.",
    ),
    (
        "I have a fear of flying, so I take trains.",
        "Do airplanes make me nervous?",
        "I get nervous before exams.",
    ),
    (
        "My anniversary dinner is booked at Chez Laurent on Friday.",
        "Where are we celebrating our special date this week?",
        "Save the date for Jenna's graduation party.",
    ),
    (
        "I'm on a gluten-free diet because of celiac disease.",
        "Can I eat bread?",
        "The bread at the new bakery is excellent.",
    ),
    (
        "My favorite author is Haruki Murakami.",
        "Which writer do I read most?",
        "I read the news every morning.",
    ),
    (
        "My phone is an iPhone 13 mini.",
        "What mobile device do I carry?",
        "Carry an umbrella, it might rain.",
    ),
    (
        "I moved to Canada from Brazil in 2016.",
        "Where did I immigrate from?",
        "Many people immigrate for work.",
    ),
    ("I'm trying to quit smoking.", "What bad habit do I want to stop?", "Please stop the music."),
    (
        "My kids are 4 and 7 years old.",
        "What ages are my children?",
        "Children under 12 travel free on the bus.",
    ),
    (
        "I am allergic to penicillin.",
        "Which antibiotic must doctors avoid giving me?",
        "The doctors at the clinic are on strike.",
    ),
    (
        "I go to the gym on Mondays, Wednesdays and Fridays.",
        "How often do I exercise?",
        "Exercise caution on icy roads.",
    ),
    (
        "I own a small bakery called Sunrise Breads.",
        "Do I run a business?",
        "I run every Sunday along the river.",
    ),
    (
        "My favorite season is autumn.",
        "Which time of year do I love most?",
        "I love the smell of fresh pasta.",
    ),
)

# (a rare word of one fact, a question repeating it)
RARE_WORD: tuple[tuple[str, str], ...] = (
    ("Mia", "Tell me about Mia."),
    ("Rex", "What do you know about Rex?"),
    ("Lyon", "What about Lyon?"),
    ("cello", "Anything about the cello?"),
    ("Spirited", "Have I seen Spirited Away?"),
    ("Leo", "Does Leo go to Lincoln?"),
    ("Tom", "Is Tom a firefighter?"),
    ("marathon", "How is the marathon going?"),
    ("ThinkPad", "Is the ThinkPad mine?"),
    ("cilantro", "Do I like cilantro?"),
    ("Priya", "Who is Priya?"),
    ("Clara", "Where does Clara live?"),
    ("Celtics", "Do I follow the Celtics?"),
    ("Chez Laurent", "When is dinner at Chez Laurent?"),
    ("Murakami", "Do I like Murakami?"),
    ("penicillin", "Am I allergic to penicillin?"),
    ("Sunrise", "What is Sunrise Breads?"),
)

# Chinese and Japanese facts, each with a question that shares a word with it and a memory
# that shares none.
CJK_ITEMS: tuple[tuple[str, str, str], ...] = (
    ("我最喜欢的茶是乌龙茶。", "乌龙茶", "我每天早上跑步。"),
    ("我最喜欢的茶是乌龙茶。", "我喜欢什么茶？", "我的车是红色的。"),
    ("我女儿对花生过敏。", "谁对花生过敏？", "我在银行工作。"),
    ("我住在上海。", "上海的天气怎么样？", "我养了一只狗。"),
    ("私の猫の名前はタマです。", "タマは元気？", "明日は雨が降ります。"),
    ("東京に住んでいます。", "東京のおすすめは？", "コーヒーが好きです。"),
    ("毎朝ジョギングをしています。", "ジョギングの時間は？", "妹は大阪にいます。"),
)


@dataclass(frozen=True)
class Quality:
    """One ranking's figures."""

    ranking: str
    recall_at_1: float
    recall_at_3: float
    rare_word_at_1: float
    cjk_at_1: float
    # recall@1 of the paraphrased questions asked of the facts alone (no distractors).
    alone_at_1: float
    # Median score of the fact when first, and of the best distractor shown for its question.
    fact_score: float
    distractor_score: float
    seconds: float


def _fact_with(word: str) -> str:
    return next(fact for fact, _, _ in ITEMS if word in fact)


# Opens a fresh store: (a name for it, its ranking) -> the store.
Opener = Callable[[str, Ranking], StoreBase]


def sqlite_stores(workdir: Path) -> Opener:
    """Embedded stores, each a file under ``workdir``."""
    return lambda name, ranking: MemoryStore.open(workdir / f"{name}.db", ranking=ranking)


def postgresql_stores(server_url: str, stack: contextlib.ExitStack) -> Opener:
    """Stores on PostgreSQL, each in a database of its own on ``server_url`` (dropped when
    ``stack`` closes)."""
    from arona_store.pg.store import PgMemoryStore
    from bench.recall_locomo import fresh_database

    def open_store(name: str, ranking: Ranking) -> StoreBase:
        url = stack.enter_context(fresh_database(server_url))
        return PgMemoryStore.open(url, ranking=ranking)

    return open_store


def _store(opener: Opener, name: str, ranking: str, distractors: bool = True) -> StoreBase:
    """A fresh ``ranking`` store of the facts, each followed by its distractor, then the
    Chinese and Japanese memories; ``distractors=False``: the facts alone."""
    store = opener(name, "hybrid" if ranking == "hybrid" else "lexical")
    nodes: list[NewNode] = []
    for fact, _, distractor in ITEMS:
        nodes.append(NewNode(text=fact, created_at=NOW - AGE_S))
        if distractors:
            nodes.append(NewNode(text=distractor, created_at=NOW - AGE_S))
    seen: set[str] = set()
    for fact, _, other in CJK_ITEMS if distractors else ():
        for text in (fact, other):
            if text not in seen:
                seen.add(text)
                nodes.append(NewNode(text=text, created_at=NOW - AGE_S))
    store.add_many(nodes)
    return store


def evaluate(ranking: str, opener: Opener) -> Quality:
    """Load the facts into a fresh ``ranking`` store and ask every question."""
    started = time.perf_counter()
    store = _store(opener, f"recall-quality-{ranking}", ranking)
    try:
        first = third = 0
        fact_scores: list[float] = []
        distractor_scores: list[float] = []
        distractors = {d for _, _, d in ITEMS}
        for fact, question, _ in ITEMS:
            hits = store.query(question, 3, now=NOW)
            texts = [h.text for h in hits]
            first += bool(texts) and texts[0] == fact
            third += fact in texts
            if texts and texts[0] == fact:
                fact_scores.append(hits[0].score)
            shown = [h.score for h in hits if h.text in distractors]
            if shown:
                distractor_scores.append(max(shown))
        rare = sum(
            bool(hits) and hits[0].text == _fact_with(word)
            for word, question in RARE_WORD
            if (hits := store.query(question, 3, now=NOW)) is not None
        )
        cjk = sum(
            bool(hits) and hits[0].text == fact
            for fact, question, _ in CJK_ITEMS
            if (hits := store.query(question, 3, now=NOW)) is not None
        )
    finally:
        store.close()
    alone = _store(opener, f"recall-quality-{ranking}-alone", ranking, distractors=False)
    try:
        alone_first = sum(
            bool(hits) and hits[0].text == fact
            for fact, question, _ in ITEMS
            if (hits := alone.query(question, 1, now=NOW)) is not None
        )
    finally:
        alone.close()
    return Quality(
        ranking=ranking,
        recall_at_1=first / len(ITEMS),
        recall_at_3=third / len(ITEMS),
        rare_word_at_1=rare / len(RARE_WORD),
        cjk_at_1=cjk / len(CJK_ITEMS),
        alone_at_1=alone_first / len(ITEMS),
        fact_score=statistics.median(fact_scores) if fact_scores else 0.0,
        distractor_score=statistics.median(distractor_scores) if distractor_scores else 0.0,
        seconds=time.perf_counter() - started,
    )


def table(results: list[Quality]) -> str:
    """The results as a Markdown table."""
    lines = [
        f"{len(ITEMS)} facts, {len(ITEMS)} distractors, {len(CJK_ITEMS)} Chinese/Japanese"
        f" questions, {len(RARE_WORD)} rare-word questions (`python -m bench.recall_quality`).",
        "",
        "| ranking | recall@1 | recall@3 | rare word @1 | zh/ja shared word @1"
        " | fact score (median, when first) | best distractor score (median, when shown)"
        " | facts alone @1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.ranking} | {r.recall_at_1:.2f} | {r.recall_at_3:.2f} | {r.rare_word_at_1:.2f}"
            f" | {r.cjk_at_1:.2f} | {r.fact_score:.2f} | {r.distractor_score:.2f}"
            f" | {r.alone_at_1:.2f} |"
        )
    return "\n".join(lines) + "\n"


def run(
    rankings: list[str], workdir: Path | None = None, server_url: str | None = None
) -> list[Quality]:
    """Evaluate each of ``rankings`` (in a temporary folder unless ``workdir`` is given; on
    the PostgreSQL server at ``server_url`` when given)."""
    with contextlib.ExitStack() as stack:
        if server_url is not None:
            opener = postgresql_stores(server_url, stack)
        else:
            if workdir is None:
                workdir = Path(
                    stack.enter_context(tempfile.TemporaryDirectory(prefix="arona-recall-quality-"))
                )
            opener = sqlite_stores(workdir)
        return [evaluate(r, opener) for r in rankings]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recall_quality", description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS, help="Markdown file to write")
    parser.add_argument(
        "--store-database-url",
        metavar="URL",
        help="the stores on PostgreSQL with pgvector: a server URL (a database is made on it"
        " for each store, dropped after)",
    )
    args = parser.parse_args(argv)
    rankings = ["lexical"]
    if semantic_available():
        rankings.append("hybrid")
    else:
        print("hybrid: not run (the semantic extra is not installed)", file=sys.stderr)
    results = run(rankings, server_url=args.store_database_url)
    text = table(results)
    if args.store_database_url:
        text += "\nEach store on PostgreSQL with pgvector (`--store-database-url`).\n"
    print(text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("# Recall quality\n\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
