// What every interop script here shares: a failure prints a JSON summary line with ok=false and exits 1,
// a success prints the script's summary and exits 0, and the whole run has a deadline.

export function fail(message) {
  process.stderr.write(`interop failed: ${message}\n`);
  process.stdout.write(`${JSON.stringify({ok: false, error: message})}\n`);
  // exit() rather than a thrown error: open gRPC streams would otherwise keep the process alive.
  process.exit(1);
}

// Runs `main` (an async function returning the summary) within `timeoutMs`.
export function run(main, timeoutMs) {
  const timer = setTimeout(() => fail(`timed out after ${timeoutMs} ms`), timeoutMs);
  main().then(
    summary => {
      clearTimeout(timer);
      process.stdout.write(`${JSON.stringify(summary)}\n`);
      process.exit(0);
    },
    error => fail(`${error?.code ?? ''} ${error?.stack ?? error}`.trim())
  );
}
