"""Writes deltaserve/bench/gate_prompts.json: the quality gate's fixed natural prompts.

Short prompts are written here by hand; long ones are excerpts of text every Python install has
(the language reference in pydoc_data, CPython 3.11 sources), copied into the JSON so the set never
changes with the interpreter. Run once; the JSON is what the gate reads.
"""

import json
import pydoc_data.topics as topics
import sys
from pathlib import Path

HAND = {
    "prose": "The lighthouse keeper had not spoken to anyone in eleven days when the supply boat "
    "finally rounded the headland. She watched it from the gallery, one hand on the cold rail, and "
    "tried to remember how conversation worked: who spoke first, how long one was allowed to talk, "
    "whether it was still polite to ask about the weather when the weather had been the only thing "
    "happening for a week and a half. The boat cut its engine below the landing. A young man she did "
    "not recognise stood up in the bow, shaded his eyes, and waved",
    "finance": "Quarterly results summary. Revenue rose 8.4% year over year to $412.7 million, "
    "driven by subscription growth in the enterprise segment, while hardware sales declined 3.1%. "
    "Gross margin expanded 120 basis points to 61.3% on a favourable product mix. Operating "
    "expenses grew 5.2%, mainly from research and development headcount. Free cash flow was $58.9 "
    "million, and the company repurchased 1.2 million shares. For the full year, management raised "
    "its revenue guidance to a range of $1.63 to $1.66 billion and now expects an operating margin of",
    "engineering": "Design review notes: the pump skid vibration issue. Accelerometers on the "
    "discharge side of pump P-101 show a dominant peak at 29.6 Hz, close to the 1x running speed of "
    "1,780 rpm. The baseplate was grouted in March, but the grout under the motor feet shows voids "
    "on the tap test. Pipe supports on the discharge header were relocated during the tie-in, which "
    "changed the piping loads on the pump nozzle. Recommended actions, in order of cost: first,",
    "multilingual": "Traduction et résumé. Le comité a approuvé le budget pour l'année prochaine, "
    "mais plusieurs membres ont demandé plus de transparence.\nDeutsch: Der Ausschuss hat den "
    "Haushalt für das nächste Jahr genehmigt, aber mehrere Mitglieder forderten mehr Transparenz.\n"
    "Español: El comité aprobó el presupuesto para el próximo año, pero varios miembros pidieron "
    "más transparencia.\n中文：委员会批准了明年的预算，但几位成员要求提高透明度。\n日本語：委員会は来年度の"
    "予算を承認したが、数人の委員はより高い透明性を求めた。\nItaliano:",
}


def excerpt(text: str, num_chars: int) -> str:
    cut = text[:num_chars]
    return cut[: cut.rfind("\n") + 1] if "\n" in cut else cut


def main() -> None:
    stdlib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    prompts = [{"id": f"{k}-short", "category": k, "text": v} for k, v in HAND.items()]
    prompts += [
        {"id": "book-assignment", "category": "book", "text": excerpt(topics.topics["assignment"], 7000)},
        {"id": "book-exceptions", "category": "book", "text": excerpt(topics.topics["exceptions"], 2100)},
        {"id": "engineering-with", "category": "engineering", "text": excerpt(topics.topics["with"], 3000)},
        {"id": "code-textwrap", "category": "code",
         "text": excerpt((stdlib / "textwrap.py").read_text(), 2400)},
        {"id": "code-fractions", "category": "code",
         "text": excerpt((stdlib / "fractions.py").read_text(), 7600)},
        {"id": "prose-import", "category": "prose", "text": excerpt(topics.topics["import"], 4500)},
    ]
    out = Path(__file__).resolve().parents[2] / "deltaserve" / "bench" / "gate_prompts.json"
    out.write_text(json.dumps({"version": 1, "prompts": prompts}, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(prompts)} prompts -> {out}")


if __name__ == "__main__":
    main()
