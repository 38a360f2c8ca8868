package sandboxcli

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"stasis/internal/insandbox/harness/mini"
)

// miniFlags are mini's flags.
type miniFlags struct {
	endpoint, modelName, workdir, session, logFormat, logLevel string
	maxSteps, outputLimit                                      int
	cmdTimeout                                                 time.Duration
	asJSON                                                     bool
}

func newMiniCmd() *cobra.Command {
	var mf miniFlags
	cmd := &cobra.Command{
		Use:     "mini --endpoint URL --model NAME --workdir DIR --session FILE [flags] -- PROMPT",
		Short:   "Run mini, the small built-in coding agent, on a task (for sandboxes without OpenCode)",
		Long:    miniLong,
		Example: miniExample,
		RunE:    mf.run,
	}
	f := cmd.Flags()
	f.StringVar(&mf.endpoint, "endpoint", "", "OpenAI base URL including /v1 (normally the relay)")
	f.StringVar(&mf.modelName, "model", "", "model name to send")
	f.StringVar(&mf.workdir, "workdir", ".", "directory the tools work in")
	f.StringVar(&mf.session, "session", "", "session file: the saved conversation, resumed when it exists")
	f.IntVar(&mf.maxSteps, "max-steps", mini.DefaultMaxSteps, "most model replies per session")
	f.DurationVar(&mf.cmdTimeout, "command-timeout", mini.DefaultCommandTimeout, "time limit of each run tool call")
	f.IntVar(&mf.outputLimit, "output-limit", mini.DefaultOutputLimit, "bytes of each tool result kept")
	f.BoolVar(&mf.asJSON, "json", false, "print the result as JSON instead of the answer")
	f.StringVar(&mf.logFormat, "log-format", "text", "log format on stderr: text or json")
	f.StringVar(&mf.logLevel, "log-level", "warn", "log level: debug, info, warn or error")
	return cmd
}

// run runs mini on the prompt args (or resumes its session).
func (mf *miniFlags) run(cmd *cobra.Command, args []string) error {
	prompt, log, err := mf.check(cmd, args)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	res, err := mini.Run(ctx, mini.Config{
		Endpoint: mf.endpoint, Model: mf.modelName, WorkDir: mf.workdir, SessionFile: mf.session, Prompt: prompt,
		MaxSteps: mf.maxSteps, CommandTimeout: mf.cmdTimeout, OutputLimit: mf.outputLimit,
		Log: cmd.ErrOrStderr(), Logger: log.With("component", "mini"),
	})
	if mf.asJSON && (err == nil || errors.Is(err, mini.ErrMaxSteps)) {
		b, jerr := json.MarshalIndent(res, "", "  ")
		if jerr != nil {
			return &exitError{Code: 1, Err: jerr}
		}
		fmt.Fprintln(cmd.OutOrStdout(), string(b))
	}
	switch {
	case err == nil:
		if !mf.asJSON {
			fmt.Fprintln(cmd.OutOrStdout(), res.Answer)
		}
		return nil
	case errors.Is(err, mini.ErrMaxSteps):
		return &exitError{Code: 3, Err: err}
	case ctx.Err() != nil:
		return &exitError{Code: 1, Err: fmt.Errorf("interrupted; the session is saved in %s: run the same command again to resume", mf.session)}
	}
	return &exitError{Code: 1, Err: err}
}

// check checks the flags and the prompt and returns the prompt and the
// logger.
func (mf *miniFlags) check(cmd *cobra.Command, args []string) (string, *slog.Logger, error) {
	if len(args) > 0 && cmd.ArgsLenAtDash() != 0 {
		return "", nil, &exitError{Code: 2, Err: errors.New(`put the prompt after --, e.g. stasis mini ... -- "fix the failing test"`)}
	}
	for _, f := range []struct{ name, val, what string }{
		{"--endpoint", mf.endpoint, "the OpenAI base URL including /v1, e.g. http://127.0.0.1:8787/v1"},
		{"--model", mf.modelName, "the model name to send"},
		{"--session", mf.session, "the session file to save the conversation to (and resume from)"},
	} {
		if f.val == "" {
			return "", nil, &exitError{Code: 2, Err: fmt.Errorf("%s is required: %s", f.name, f.what)}
		}
	}
	if !strings.HasPrefix(mf.endpoint, "http://") && !strings.HasPrefix(mf.endpoint, "https://") {
		return "", nil, &exitError{Code: 2, Err: fmt.Errorf("--endpoint %q: give an http:// or https:// URL ending in /v1", mf.endpoint)}
	}
	if mf.maxSteps <= 0 {
		return "", nil, &exitError{Code: 2, Err: fmt.Errorf("--max-steps %d: give a positive number", mf.maxSteps)}
	}
	if mf.cmdTimeout <= 0 {
		return "", nil, &exitError{Code: 2, Err: fmt.Errorf("--command-timeout %s: give a positive duration", mf.cmdTimeout)}
	}
	if mf.outputLimit <= 0 {
		return "", nil, &exitError{Code: 2, Err: fmt.Errorf("--output-limit %d: give a positive number of bytes", mf.outputLimit)}
	}
	prompt := strings.TrimSpace(strings.Join(args, " "))
	if prompt == "" {
		if _, err := os.Stat(mf.session); err != nil {
			return "", nil, &exitError{Code: 2, Err: fmt.Errorf("no prompt: give it after --, or a --session file to resume (%s: %v)", mf.session, err)}
		}
	}
	log, err := newLogger(mf.logFormat, mf.logLevel)
	if err != nil {
		return "", nil, &exitError{Code: 2, Err: err}
	}
	return prompt, log, nil
}

const miniLong = `mini is a small tool-calling coding agent built into stasis, for sandboxes
that cannot run OpenCode. It talks the OpenAI chat-completions API
(POST URL/chat/completions, not streamed) to --endpoint, normally the stasis
relay, and works in --workdir with four tools:

  run         run a shell command with /bin/sh -c in the work directory
              (stdin empty; killed with its process group after
              --command-timeout); the model gets the exit code and the
              combined stdout and stderr
  read_file   read a file
  write_file  create or overwrite a file, creating missing directories
  edit_file   replace exactly one occurrence of a text in a file (an error,
              changing nothing, when it occurs zero or several times)

Relative paths are relative to --workdir. A failing tool call, or one with
malformed arguments, gives the model the error as its result, and the agent
goes on. Each tool result keeps at most --output-limit bytes (the start and
the end of a command's output, the start of a file), with a note saying what
was left out.

Each model reply without tool calls is the final answer: mini prints it and
exits 0. A reply with tool calls runs them and calls the model again, up to
--max-steps model replies per session.

The session file (--session) holds the conversation, JSON with a format
version. It is written atomically and durably after every model reply and
after every tool result. When it exists at start, mini resumes it and the
PROMPT is ignored (it may be left out): tool calls of the last reply that
have no result yet run first, then the loop goes on, re-sending the saved
history byte for byte, so the gateway matches it against its ledger. A
session that already has a final answer prints it without calling the
model. A malformed file, or one of another version, is an error and is left
as it is; mini never starts over by itself (remove the file for that).

Model calls that fail to connect, or answer 429 (Retry-After honoured) or
5xx, are retried a few times with exponential backoff and jitter; any other
4xx ends the run.

Progress goes to stderr, one line per tool call:
  step 3: run ` + "`go test ./...`" + ` → exit 1

Exit status: 0 a final answer (printed; with --json the result as JSON);
3 --max-steps replies without a final answer (the session can be resumed
with a higher limit); 2 a usage error; 1 any other error, or SIGINT/SIGTERM
(the session is saved: run the same command again to resume).`

const miniExample = `  stasis mini --endpoint http://127.0.0.1:8787/v1 --model stasis-scripted \
      --workdir /work --session /tmp/mini/session.json -- "fix the failing test"
  stasis mini --endpoint http://127.0.0.1:8787/v1 --model stasis-scripted \
      --workdir /work --session /tmp/mini/session.json --json   # resume`
