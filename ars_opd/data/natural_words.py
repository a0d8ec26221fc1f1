"""The facts behind the natural prompts' checkable kinds, and each kind's vocabulary of candidate answers.

One table per word kind: (what the prompt names, the one reference answer). Entries were left out where a
second answer is as right (Bolivia's two capitals, "old" -> "young" or "new", "small" -> "big" or "large",
"narrow" -> "wide" or "broad", "fish" -> "fish", China's "Chinese" or "Mandarin", "dreamed"/"dreamt"), where
the prompt would contain its own answer (the capital of
Mexico, the continent of South Africa, the past tense of "read"), and where the answer is a common English
word that would turn up in any sentence (the symbols He, I, As, Be, In; Brazil's real), since the checker
(``ars_opd.data.natural_check``) finds an answer as whole words in a sentence. ``CANDIDATES`` is every
answer a kind can have: the checker's distractors. ``ALIASES`` are other words that give the same answer: a
continent's adjective ("part of the African continent" answers Africa; the teacher says so about one time in
ten). The numeric kinds (``NUMERIC_KINDS``) have no table: their candidates are all numbers, in digits or
words.
"""

from __future__ import annotations


def _pairs(text: str) -> tuple[tuple[str, str], ...]:
    """``"a: b; c: d"`` -> ((a, b), (c, d)), white space around each part dropped."""
    return tuple(tuple(p.strip() for p in item.split(":")) for item in text.split(";") if item.strip())


CAPITALS = _pairs("""
Afghanistan: Kabul; Albania: Tirana; Algeria: Algiers; Angola: Luanda; Argentina: Buenos Aires; Armenia: Yerevan;
Australia: Canberra; Austria: Vienna; Azerbaijan: Baku; Bangladesh: Dhaka; Belarus: Minsk; Belgium: Brussels;
Brazil: Brasilia; Bulgaria: Sofia; Cambodia: Phnom Penh; Canada: Ottawa; Chile: Santiago; China: Beijing;
Colombia: Bogota; Croatia: Zagreb; Cuba: Havana; Cyprus: Nicosia; the Czech Republic: Prague; Denmark: Copenhagen;
Ecuador: Quito; Egypt: Cairo; Estonia: Tallinn; Ethiopia: Addis Ababa; Finland: Helsinki; France: Paris;
Germany: Berlin; Ghana: Accra; Greece: Athens; Honduras: Tegucigalpa; Hungary: Budapest; Iceland: Reykjavik;
India: New Delhi; Indonesia: Jakarta; Iran: Tehran; Iraq: Baghdad; Ireland: Dublin; Italy: Rome;
Jamaica: Kingston; Japan: Tokyo; Jordan: Amman; Kenya: Nairobi; Latvia: Riga; Lebanon: Beirut; Libya: Tripoli;
Lithuania: Vilnius; Malaysia: Kuala Lumpur; Mali: Bamako; Morocco: Rabat; Nepal: Kathmandu;
the Netherlands: Amsterdam; New Zealand: Wellington; Nigeria: Abuja; North Korea: Pyongyang; Norway: Oslo;
Pakistan: Islamabad; Paraguay: Asuncion; Peru: Lima; the Philippines: Manila; Poland: Warsaw; Portugal: Lisbon;
Qatar: Doha; Romania: Bucharest; Russia: Moscow; Saudi Arabia: Riyadh; Senegal: Dakar; Serbia: Belgrade;
Slovakia: Bratislava; Slovenia: Ljubljana; South Korea: Seoul; Spain: Madrid; Sudan: Khartoum; Sweden: Stockholm;
Switzerland: Bern; Syria: Damascus; Thailand: Bangkok; Tunisia: Tunis; Turkey: Ankara; Uganda: Kampala;
the United Kingdom: London; Uruguay: Montevideo; Venezuela: Caracas; Vietnam: Hanoi; Zambia: Lusaka;
Zimbabwe: Harare
""")

CONTINENTS = _pairs("""
Algeria: Africa; Angola: Africa; Botswana: Africa; Cameroon: Africa; Egypt: Africa; Ethiopia: Africa;
Ghana: Africa; Kenya: Africa; Libya: Africa; Madagascar: Africa; Mali: Africa; Morocco: Africa; Namibia: Africa;
Nigeria: Africa; Rwanda: Africa; Senegal: Africa; Somalia: Africa; Sudan: Africa; Tunisia: Africa;
Uganda: Africa; Zambia: Africa; Zimbabwe: Africa; Chad: Africa; Niger: Africa; Mozambique: Africa;
Malawi: Africa; Gabon: Africa; Benin: Africa; Togo: Africa; Sierra Leone: Africa; Liberia: Africa;
Eritrea: Africa; Mauritania: Africa; Burundi: Africa;
Afghanistan: Asia; Bangladesh: Asia; Cambodia: Asia; China: Asia; India: Asia; Iraq: Asia; Japan: Asia;
Laos: Asia; Malaysia: Asia; Mongolia: Asia; Myanmar: Asia; Nepal: Asia; North Korea: Asia; Pakistan: Asia;
the Philippines: Asia; Saudi Arabia: Asia; South Korea: Asia; Sri Lanka: Asia; Thailand: Asia; Vietnam: Asia;
Bhutan: Asia; Oman: Asia; Yemen: Asia; Qatar: Asia; Kuwait: Asia; Jordan: Asia; Syria: Asia; Lebanon: Asia;
Uzbekistan: Asia; Singapore: Asia; Iran: Asia;
Austria: Europe; Belgium: Europe; Bulgaria: Europe; Croatia: Europe; Denmark: Europe; Finland: Europe;
France: Europe; Germany: Europe; Greece: Europe; Hungary: Europe; Iceland: Europe; Ireland: Europe; Italy: Europe;
the Netherlands: Europe; Norway: Europe; Poland: Europe; Portugal: Europe; Romania: Europe; Serbia: Europe;
Slovakia: Europe; Spain: Europe; Sweden: Europe; Switzerland: Europe; Ukraine: Europe; Estonia: Europe;
Latvia: Europe; Lithuania: Europe; Belarus: Europe; Slovenia: Europe; Albania: Europe; Luxembourg: Europe;
Malta: Europe; Moldova: Europe;
Canada: North America; the United States: North America; Mexico: North America;
Argentina: South America; Bolivia: South America; Brazil: South America; Chile: South America;
Colombia: South America; Ecuador: South America; Paraguay: South America; Peru: South America;
Uruguay: South America; Venezuela: South America; Guyana: South America; Suriname: South America
""")

LANGUAGES = _pairs("""
Argentina: Spanish; Austria: German; Brazil: Portuguese; Bulgaria: Bulgarian; Chile: Spanish; Colombia: Spanish;
Croatia: Croatian; Cuba: Spanish; Denmark: Danish; Egypt: Arabic; England: English; Finland: Finnish;
France: French; Germany: German; Greece: Greek; Hungary: Hungarian; Iceland: Icelandic; Indonesia: Indonesian;
Israel: Hebrew; Italy: Italian; Japan: Japanese; Mexico: Spanish; the Netherlands: Dutch; Norway: Norwegian;
Peru: Spanish; Poland: Polish; Portugal: Portuguese; Romania: Romanian; Russia: Russian; Saudi Arabia: Arabic;
Serbia: Serbian; South Korea: Korean; Spain: Spanish; Sweden: Swedish; Thailand: Thai; Turkey: Turkish;
Ukraine: Ukrainian; the United States: English; Venezuela: Spanish; Vietnam: Vietnamese
""")

CURRENCIES = _pairs("""
Argentina: peso; Australia: dollar; Austria: euro; Canada: dollar; Chile: peso; Denmark: krone; Egypt: pound;
France: euro; Germany: euro; Greece: euro; Hungary: forint; India: rupee; Indonesia: rupiah; Ireland: euro;
Israel: shekel; Italy: euro; Japan: yen; Kenya: shilling; Malaysia: ringgit; Mexico: peso; Nigeria: naira;
Norway: krone; Pakistan: rupee; the Philippines: peso; Portugal: euro; Russia: ruble; Saudi Arabia: riyal;
South Africa: rand; Spain: euro; Sweden: krona; Switzerland: franc; Thailand: baht; Turkey: lira;
the United Kingdom: pound; the United States: dollar; Vietnam: dong
""")

OPPOSITES = _pairs("""
hot: cold; cold: hot; big: small; happy: sad; sad: happy; up: down; down: up; fast: slow; slow: fast;
young: old; closed: open; high: low; low: high; wet: dry; dry: wet; early: late; late: early; full: empty;
empty: full; thick: thin; rich: poor; poor: rich; strong: weak; weak: strong;
long: short; tall: short; clean: dirty; dirty: clean; dark: light; heavy: light; day: night; night: day;
black: white; white: black; bad: good; true: false; false: true; love: hate; hate: love;
win: lose; inside: outside; outside: inside; left: right; push: pull; pull: push; buy: sell;
sell: buy; north: south; south: north; east: west; west: east; top: bottom; bottom: top; before: after;
after: before; first: last; always: never; never: always; more: less; less: more; same: different;
cheap: expensive; deep: shallow; shallow: deep; friend: enemy; enemy: friend;
asleep: awake; awake: asleep; alive: dead; dead: alive; above: below; below: above; war: peace; peace: war;
wide: narrow; possible: impossible; increase: decrease; decrease: increase; odd: even;
positive: negative; negative: positive; sunrise: sunset; sunset: sunrise; floor: ceiling; success: failure;
question: answer; answer: question; smooth: rough; rough: smooth; tight: loose; loose: tight;
visible: invisible; summer: winter; winter: summer; import: export; export: import; safe: dangerous;
dangerous: safe; beginning: end; arrival: departure; departure: arrival; king: queen; queen: king;
boy: girl; girl: boy; man: woman; woman: man; accept: reject; maximum: minimum; minimum: maximum
""")

PLURALS = _pairs("""
mouse: mice; child: children; foot: feet; tooth: teeth; man: men; woman: women; goose: geese; person: people;
ox: oxen; louse: lice; knife: knives; leaf: leaves; wolf: wolves; life: lives; wife: wives; half: halves;
loaf: loaves; shelf: shelves; thief: thieves; calf: calves; elf: elves; potato: potatoes; tomato: tomatoes;
hero: heroes; echo: echoes; city: cities; baby: babies; lady: ladies; party: parties; story: stories;
family: families; country: countries; fly: flies; berry: berries; box: boxes; fox: foxes; bus: buses;
church: churches; watch: watches; dish: dishes; brush: brushes; glass: glasses; class: classes; kiss: kisses;
match: matches; beach: beaches; bench: benches; lunch: lunches; wish: wishes; tax: taxes; cat: cats; dog: dogs;
book: books; car: cars; tree: trees; house: houses; bird: birds; apple: apples; chair: chairs; table: tables;
pen: pens; cup: cups; door: doors; window: windows; girl: girls; boy: boys; key: keys; day: days; toy: toys;
monkey: monkeys; horse: horses; river: rivers; mountain: mountains; flower: flowers; bottle: bottles;
shoe: shoes; hat: hats; bag: bags; star: stars; cloud: clouds; ship: ships; egg: eggs; lamp: lamps;
bridge: bridges; road: roads; teacher: teachers; doctor: doctors; student: students; farmer: farmers;
crisis: crises; analysis: analyses; thesis: theses; phenomenon: phenomena; criterion: criteria;
nucleus: nuclei; stimulus: stimuli; dress: dresses; peach: peaches; hobby: hobbies; puppy: puppies;
army: armies; butterfly: butterflies; photo: photos; piano: pianos; zoo: zoos; kangaroo: kangaroos;
video: videos; radio: radios; boat: boats; train: trains; plane: planes; cookie: cookies; garden: gardens;
pencil: pencils; candle: candles; tiger: tigers; rabbit: rabbits; frog: frogs; spider: spiders; snake: snakes;
camera: cameras; computer: computers; village: villages; island: islands; ocean: oceans; forest: forests
""")

PAST_TENSES = _pairs("""
go: went; eat: ate; see: saw; write: wrote; run: ran; take: took; make: made; come: came; give: gave;
sing: sang; drink: drank; swim: swam; begin: began; break: broke; bring: brought; build: built; buy: bought;
catch: caught; choose: chose; do: did; draw: drew; drive: drove; fall: fell; feel: felt; fight: fought;
find: found; fly: flew; forget: forgot; grow: grew; have: had; hear: heard; hold: held; keep: kept;
know: knew; leave: left; lose: lost; meet: met; pay: paid; ride: rode; say: said; sell: sold; send: sent;
sit: sat; sleep: slept; speak: spoke; spend: spent; stand: stood; steal: stole; teach: taught; tell: told;
think: thought; throw: threw; understand: understood; wear: wore; win: won; walk: walked; play: played;
jump: jumped; talk: talked; cook: cooked; dance: danced; open: opened; help: helped; laugh: laughed;
clean: cleaned; listen: listened; smile: smiled; carry: carried; study: studied; stop: stopped;
plan: planned; visit: visited; work: worked; call: called
""")

CHEMICAL_SYMBOLS = _pairs("""
hydrogen: H; lithium: Li; boron: B; carbon: C; nitrogen: N; oxygen: O; fluorine: F; neon: Ne; sodium: Na;
magnesium: Mg; aluminium: Al; silicon: Si; phosphorus: P; sulfur: S; chlorine: Cl; argon: Ar; potassium: K;
calcium: Ca; titanium: Ti; chromium: Cr; manganese: Mn; iron: Fe; cobalt: Co; nickel: Ni; copper: Cu;
zinc: Zn; bromine: Br; krypton: Kr; silver: Ag; tin: Sn; xenon: Xe; barium: Ba; tungsten: W; platinum: Pt;
gold: Au; mercury: Hg; lead: Pb; radon: Rn; uranium: U; plutonium: Pu
""")

TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    "nl_capital": CAPITALS,
    "nl_continent": CONTINENTS,
    "nl_language": LANGUAGES,
    "nl_currency": CURRENCIES,
    "nl_opposite": OPPOSITES,
    "nl_plural": PLURALS,
    "nl_past_tense": PAST_TENSES,
    "nl_chemical_symbol": CHEMICAL_SYMBOLS,
}
NUMERIC_KINDS = ("nl_sum", "nl_difference")
CHECKABLE_KINDS = (*TABLES, *NUMERIC_KINDS)
# every answer a word kind can have: the checker's distractors (for opposites every word of the table, either side)
CANDIDATES: dict[str, tuple[str, ...]] = {
    kind: tuple(sorted({a.lower() for _, a in table} | {q.lower() for q, _ in table if kind == "nl_opposite"}))
    for kind, table in TABLES.items()
}
CANDIDATES["nl_continent"] = tuple(sorted({*CANDIDATES["nl_continent"], "antarctica", "australia", "oceania"}))
ALIASES: dict[str, dict[str, str]] = {
    "nl_continent": {
        "african": "africa",
        "asian": "asia",
        "european": "europe",
        "north american": "north america",
        "south american": "south america",
    },
}
