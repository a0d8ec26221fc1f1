# Sourced by the sweep scripts: start the DVC experiment queue and wait until it has run everything.
run_queue() {
  time dvc queue start --jobs 1
  # (status captured first: with pipefail, grep -q closing the pipe early would end the wait at once)
  # (a hung `dvc queue status` counts as still running, not as done)
  while status=$(timeout 120 dvc queue status || echo Running) && grep -Eq "Queued|Running" <<<"$status"; do
    sleep 30
  done
  timeout 120 dvc queue status || true
}
