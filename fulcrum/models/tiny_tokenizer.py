"""The tiny models' tokenizer: a byte-level BPE the project trains on text it generates itself.

Byte-level means every UTF-8 byte is a base token, so any text encodes losslessly
(`decode(encode(s)) == s`), whatever it contains. The merges are learnt from a corpus of
GSM8K-style word problems and worked solutions made from the templates and word list below (never
from the GSM8K release), so the usual words and calculator annotations of math word problems take
few tokens and the tiny models see short sequences.

The trained tokenizer is shipped as `tiny_tokenizer.json` next to this file rather than trained at
call time: training takes about a second, but the merges a BPE trainer picks among equally frequent
pairs may change between `tokenizers` releases, and a shipped file keeps token ids (and so every
tiny checkpoint) the same on every machine. `python -m fulcrum.models.tiny_tokenizer` rebuilds it;
a test checks that the rebuild matches the shipped file with the installed `tokenizers`.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

TOKENIZER_JSON = Path(__file__).with_name("tiny_tokenizer.json")

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a chat turn: the tiny models' EOS, as in Qwen's instruct models
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
VOCAB_SIZE = 2048  # specials + 256 bytes + merges: small, so the LM head is cheap on the CPU

# Qwen2's pre-tokenisation split (letters, single digits, punctuation runs, newlines, spaces).
# Single digits keep arithmetic learnable and make the merges independent of the numbers drawn.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# Qwen-style chat template: one `<|im_start|>role\n...<|im_end|>\n` block per message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_NAMES = (
    "Janet James John Mary Maria Tom Anna Ben Carla David Emma Frank Grace Henry Isabel Jack Kate Liam "
    "Mia Noah Olivia Peter Rosa Sam Tina Uma Victor Wendy Zoe Alice Bob Carlos Diana Ethan Fiona George "
    "Hannah Ivan Julia Kevin Laura Mark Nina Oscar Paula Raj Sara Tyler Yuki"
).split()
_ITEMS = (
    "apples oranges eggs cookies books pencils marbles stickers cupcakes shirts candies flowers toys "
    "cards bottles boxes chairs tickets cars bags coins plates shells rocks balloons muffins pies "
    "sandwiches pizzas lemons bananas peaches notebooks crayons dolls puzzles games songs pages miles "
    "trees seeds plants fish birds dogs cats cows chickens ducks sheep horses bricks tiles shoes socks"
).split()
_PLACES = (
    "store market farm school park library bakery garden zoo beach office kitchen shop class museum "
    "house street city village field"
).split()
_UNITS = (
    "dollars cents hours minutes days weeks months years meters feet inches pounds kilograms liters".split()
)
_VERBS = (
    "buys sells has gets gives makes eats finds picks reads bakes collects plants saves spends earns "
    "loses keeps shares orders packs uses needs wants pays costs drives walks runs swims works writes"
).split()
_COMMON = (
    "the of and to a in is it you that he was for on are with as his they be at one have this from or "
    "had by hot but some what there we can out other were all your when up use word how said an each she "
    "which do their time if will way about many then them would write like so these her long make thing "
    "see him two has look more day could go come did my sound no most number who over know water than "
    "call first people may down side been now find any new work part take get place made live where after "
    "back little only round man year came show every good me give our under name very through just form "
    "much great think say help low line before turn cause same mean differ move right boy old too does "
    "tell sentence set three want air well also play small end put home read hand port large spell add "
    "even land here must big high such follow act why ask men change went light kind off need house "
    "picture try us again animal point mother world near build self earth father head stand own page "
    "should country found answer grow study still learn plant cover food sun four thought let keep eye "
    "never last door between city tree cross since hard start might story saw far sea draw left late run "
    "while press close night real life few stop open seem together next white children begin got walk "
    "example ease paper often always music those both mark book letter until mile river car feet care "
    "second group carry took rain eat room friend began idea fish mountain north once base hear horse cut "
    "sure watch color face wood main enough plain girl usual young ready above ever red list though feel "
    "talk bird soon body dog family direct pose leave song measure state product black short numeral "
    "class wind question happen complete ship half rest total cost price money bought sold each week month "
    "hour minute percent twice triple double remaining altogether together dollars cents spent earned "
    "paid buy sell save spend earn pay received bake cook ride drive swim travel weigh fill pour divide "
    "multiply subtract every per average whole equal equally shared share gallons cups slices pieces "
    "packs bags boxes rows columns students teacher teachers parents brother sister friends team teams "
    "players games points score scored goals laps pages chapters episodes minutes seconds yards acres"
).split()
_PROSE = (
    "How many does she have left? How much money does he make every day? What is the total cost? "
    "How many more does it take? Each one costs the same amount. After that, the rest are shared "
    "equally between them. She wants to know the answer in dollars, and he says the price is fair. "
    "First we find the number per day, then we multiply by the number of days in a week. "
    'Let\'s think step by step and output the final answer after "####". '
    "The answer is the number of items that remain at the end. So the total is the sum of both parts. "
    "Half of them are red, a third are blue, and the remaining ones are green or yellow. "
    "If there are twice as many, then there are two times the amount. A quarter means one of four equal "
    "parts, and a percent is one part in a hundred. The average is the total divided by the count. "
    "Every morning, every week, per hour, per person, in total, altogether, remaining, left over, "
    "more than, less than, fewer than, profit, discount, price, rate, speed, distance, time, area, "
    "width, length, height, weight, age, older, younger, years old, twice, three times, dozen. "
    "The quick brown fox jumps over the lazy dog. You are a helpful assistant. "
    "The user asks a question and the assistant answers it with care, showing each step of the work."
)


def _problem(rng: random.Random) -> str:
    """One GSM8K-style question and worked solution with `<<a op b=c>>` annotations and `#### n`."""
    name, other = rng.sample(_NAMES, 2)
    item, place, unit, verb = rng.choice(_ITEMS), rng.choice(_PLACES), rng.choice(_UNITS), rng.choice(_VERBS)
    a, b, c = rng.randint(2, 99), rng.randint(2, 40), rng.randint(2, 12)
    price = rng.choice([1, 2, 3, 4, 5, 10, 12, 15, 20, 25, 50, 100, 1200])
    total, left = a * c, a * c - b
    money = left * price
    money_text = f"{money:,}" if rng.random() < 0.3 else str(money)
    question = (
        f"{name} {verb} {a} {item} at the {place} every day for {c} days. {name} gives {b} of them to "
        f"{other} and sells the rest for ${price} each. How many {unit} does {name} make?"
    )
    solution = (
        f"{name} has {a} * {c} = <<{a}*{c}={total}>>{total} {item}.\n"
        f"After giving {b} away, {total} - {b} = <<{total}-{b}={left}>>{left} {item} are left.\n"
        f"So {name} makes {left} * ${price} = $<<{left}*{price}={money}>>{money_text}.\n"
        f"#### {money}"
    )
    if rng.random() < 0.3:
        frac = rng.choice([0.5, 0.25, 1.5, 2.5, 0.75])
        solution = (
            f"Half is {a}/2 = <<{a}/2={a / 2:g}>>{a / 2:g}, and {frac} * {b} = {frac * b:g}.\n" + solution
        )
    return question + "\n" + solution


def corpus(num_problems: int = 4000, seed: int = 0) -> Iterator[str]:
    """The training text: word problems, the prose above, every word alone and in chat markup."""
    rng = random.Random(seed)
    for _ in range(num_problems):
        yield _problem(rng)
    words = _NAMES + _ITEMS + _PLACES + _UNITS + _VERBS + _COMMON
    for _ in range(20):
        yield _PROSE
        rng.shuffle(words)  # varied neighbours, so no pair of words gets a merge of its own
        yield " ".join(words) + "\n" + " ".join(w.capitalize() for w in words) + "\n"
    for role in ("system", "user", "assistant"):
        yield f"{IM_START}{role}\n{_PROSE}{IM_END}\n" * 4


def train_tokenizer(vocab_size: int = VOCAB_SIZE, seed: int = 0) -> Tokenizer:
    """Train the byte-level BPE on `corpus(seed=seed)`; specials get ids 0, 1, 2."""
    tokenizer = Tokenizer(models.BPE())
    # No normaliser: NFC or lower-casing would make encoding lossy.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed=seed), trainer=trainer)
    return tokenizer


def load_tokenizer() -> Tokenizer:
    """The shipped tokenizer (`tiny_tokenizer.json`)."""
    if not TOKENIZER_JSON.is_file():
        raise FileNotFoundError(
            f"{TOKENIZER_JSON} is missing from the installed package; "
            "rebuild it with `python -m fulcrum.models.tiny_tokenizer`"
        )
    return Tokenizer.from_file(str(TOKENIZER_JSON))


def main(argv: list[str] | None = None) -> int:
    """Rebuild the shipped `tiny_tokenizer.json` (or write it to argv[0])."""
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else TOKENIZER_JSON
    tokenizer = train_tokenizer()
    tokenizer.save(str(out))
    print(f"wrote {out} ({tokenizer.get_vocab_size()} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
