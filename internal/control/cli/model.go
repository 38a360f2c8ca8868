package cli

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/spf13/cobra"

	"stasis/internal/control/model"
	"stasis/internal/control/serve"
	"stasis/internal/control/task"
)

// modelFlags are model's flags.
type modelFlags struct {
	listen, scriptPath, name, logFormat, logLevel string
	tasksSpec, repos                              string
	seed                                          int64
	delay                                         time.Duration
	failRate                                      float64
}

func newModelCmd() *cobra.Command {
	var mf modelFlags
	cmd := &cobra.Command{
		Use:     "model --listen ADDR [--script FILE] [--seed N] [--token-delay D] [--fail RATE]",
		Short:   "Serve a scripted OpenAI-compatible model for tests, benchmarks and the demo",
		Long:    modelLong,
		Example: modelExample,
		Args:    cobra.NoArgs,
		RunE:    mf.run,
	}
	f := cmd.Flags()
	f.StringVar(&mf.listen, "listen", "", "address to serve on: host:port or unix:/path")
	f.StringVar(&mf.scriptPath, "script", "", "JSON script of the conversation (default: read README.md, run ls, answer)")
	f.StringVar(&mf.tasksSpec, "tasks", "", "also solve these tasks (builtin, a task directory, or SWE-bench JSONL with --repos) with their reference solutions")
	f.StringVar(&mf.repos, "repos", "", "the directory of git clones a SWE-bench --tasks file refers to")
	f.Int64Var(&mf.seed, "seed", 0, "seed of ids, timestamps, logprobs and faults")
	f.DurationVar(&mf.delay, "token-delay", 0, "time to spend per generated token")
	f.Float64Var(&mf.failRate, "fail", 0, "fraction of requests that fail with 429, 500 or a dropped connection")
	f.StringVar(&mf.name, "name", model.DefaultName, "model name listed by /v1/models")
	f.StringVar(&mf.logFormat, "log-format", "text", "log format on stderr: text or json")
	f.StringVar(&mf.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	return cmd
}

// run serves the scripted model until a signal.
func (mf *modelFlags) run(cmd *cobra.Command, _ []string) error {
	ctx, stop := serve.OnSignal(cmd.Context())
	defer stop()
	log, script, scripts, err := mf.load()
	if err != nil {
		return err
	}
	ln, shown, err := serve.Listen(mf.listen)
	if err != nil {
		return &exitError{Code: 1, Err: fmt.Errorf("--listen: %w", err)}
	}
	log = log.With("component", "model")
	h := model.New(model.Options{
		Script: script, Scripts: scripts, Seed: mf.seed, TokenDelay: mf.delay, FailRate: mf.failRate, Name: mf.name, Logger: log,
	})
	fmt.Fprintln(cmd.OutOrStdout(), shown)
	log.Info("serving", "addr", shown, "script", script.Name, "turns", len(script.Turns), "task_scripts", len(scripts), "seed", mf.seed,
		"token_delay", mf.delay, "fail", mf.failRate, "model", h.Name())
	if err := serve.UntilSignal(ctx, ln, h, log); err != nil {
		return &exitError{Code: 1, Err: err}
	}
	return nil
}

// load checks the flags and loads the script and the tasks' scripts.
func (mf *modelFlags) load() (*slog.Logger, *model.Script, []*model.Script, error) {
	if mf.listen == "" {
		return nil, nil, nil, &exitError{Code: 2, Err: errors.New("--listen is required: host:port (port 0 picks one) or unix:/path")}
	}
	if mf.delay < 0 {
		return nil, nil, nil, &exitError{Code: 2, Err: errors.New("--token-delay must not be negative")}
	}
	if math.IsNaN(mf.failRate) || mf.failRate < 0 || mf.failRate > 1 {
		return nil, nil, nil, &exitError{Code: 2, Err: fmt.Errorf("--fail %v: give a fraction from 0 to 1", mf.failRate)}
	}
	log, err := newLogger(mf.logFormat, mf.logLevel)
	if err != nil {
		return nil, nil, nil, &exitError{Code: 2, Err: err}
	}
	script := model.DefaultScript()
	if mf.scriptPath != "" {
		if script, err = model.LoadScript(mf.scriptPath); err != nil {
			return nil, nil, nil, &exitError{Code: 2, Err: err}
		}
	}
	var scripts []*model.Script
	if mf.tasksSpec != "" {
		ts, problems, err := task.Load(mf.tasksSpec, task.SWEBenchOptions{Repos: mf.repos})
		if err != nil {
			return nil, nil, nil, &exitError{Code: 2, Err: err}
		}
		for _, p := range problems {
			log.Warn("task not loaded", "err", p)
		}
		if scripts, err = task.Scripts(ts); err != nil {
			return nil, nil, nil, &exitError{Code: 2, Err: err}
		}
	}
	return log, script, scripts, nil
}

const modelLong = `model serves a scripted policy model over the OpenAI API:

  POST /v1/chat/completions   streamed (SSE, ending with data: [DONE]) or not
  POST /v1/responses          streamed or not (best effort)
  GET  /v1/models             lists the model name (--name)
  GET  /healthz               "ok"
  GET  /metrics               Prometheus text: requests, faults, tokens

ADDR is host:port (port 0 picks a free port) or unix:/path. Once listening,
model prints the address on stdout, one line (host:port, or unix:/path), and
serves until SIGTERM or SIGINT, then shuts down gracefully and exits 0.

The answers come from a JSON script (--script; without it a built-in one
reads README.md, runs ls, and answers). Turn k of the script answers a
request that already holds k assistant messages, so a harness that re-sends
its history gets the same next turn. A script is a list of turns, each tool
calls or a final answer; a call may name alternatives for harnesses whose
tools are named differently:

  [{"tool_calls": [{"name": "read_file", "arguments": {"path": "README.md"},
                    "alternatives": [{"name": "read", "arguments": {"filePath": "README.md"}}]}]},
   {"content": "Done."}]

Tool calls are made only when the request offers one of the names; otherwise
the answer is a text saying so.

Every response carries token ids of a byte-level tokenizer the way vLLM
returns them (prompt_token_ids; token_ids and logprobs in the choice) and a
usage that matches them. The same request and --seed give the same bytes.

Faults: --fail RATE makes that fraction of requests answer 429 (with
Retry-After) or 500, or drop the connection mid-stream, drawn from the seed,
the request and how often the same request came before. The request header
X-Stasis-Fault: 429|500|drop|none forces one.

--token-delay D sleeps D per generated token, streamed or not, to simulate
generation time.

With --tasks it also solves tasks: a conversation whose user message holds a
task's problem statement gets that task's script, made from its reference
solution (look at the tree, read each file the fix changes, write it, run
the tests, answer; one step per call). Other conversations get the script.

Exit status: 0 after a signal; 2 a usage error (bad flag or script); 1 the
address cannot be listened on, or the server failed.`

const modelExample = `  stasis model --listen 127.0.0.1:0
  stasis model --listen unix:/tmp/model.sock --script fix.json --seed 7 --token-delay 5ms --fail 0.1
  stasis model --listen 127.0.0.1:8080 --tasks builtin`
