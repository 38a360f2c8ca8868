// Package mini is a small tool-calling coding agent built into stasis, for
// sandboxes that cannot run OpenCode (the microVM guest). It owns the agent
// loop, its four tools (run a shell command, read a file, write a file, edit
// a file by replacing one exact occurrence of a text), the calls to an
// OpenAI-compatible chat-completions endpoint (normally the stasis relay),
// and the session file from which a relaunched agent continues.
//
// The loop: send the conversation with the tools; run each tool call of the
// reply and add one tool message per call; call again; a reply without tool
// calls is the final answer. The conversation is saved after every model
// reply and after every tool result, atomically and durably, so a relaunch
// (after a crash, a kill, or a restore from a file-only snapshot) continues
// where the file ends: tool calls still without a result run first, then the
// loop goes on. Every message is kept byte for byte as it was sent — the
// assistant messages exactly as the server returned them — so the relaunched
// agent re-sends the very history the gateway has in its ledger.
package mini

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Defaults of Config.
const (
	DefaultMaxSteps       = 50
	DefaultCommandTimeout = 10 * time.Minute
	DefaultOutputLimit    = 16 << 10
)

// ErrMaxSteps is wrapped by Run's error when the session reached MaxSteps
// model replies without a final answer.
var ErrMaxSteps = errors.New("no final answer within the step limit")

// Config configures Run.
type Config struct {
	// Endpoint is the OpenAI base URL including /v1, e.g.
	// http://127.0.0.1:7070/v1; requests go to Endpoint/chat/completions.
	Endpoint string
	// Model is the model name sent with every request.
	Model string
	// WorkDir is the directory commands run in and relative paths are
	// resolved against; "" is the current directory.
	WorkDir string
	// SessionFile is where the conversation is saved; when it exists at
	// start, Run resumes it.
	SessionFile string
	// Prompt is the task, the first user message. It is ignored when the
	// session file exists.
	Prompt string
	// MaxSteps bounds the model replies of the whole session, resumed runs
	// included; 0 means DefaultMaxSteps.
	MaxSteps int
	// CommandTimeout bounds each run tool call; 0 means
	// DefaultCommandTimeout.
	CommandTimeout time.Duration
	// OutputLimit is how many bytes of a tool's output are kept per call (the
	// start and the end of a command's output, the start of a file), with a
	// note saying what was left out; 0 means DefaultOutputLimit.
	OutputLimit int
	// HTTPClient makes the model calls; nil means a client without a
	// timeout (a relay may hold a call for as long as a checkpoint takes).
	HTTPClient *http.Client
	// Log receives one progress line per tool call and at the end; nil
	// discards them.
	Log io.Writer
	// Logger receives diagnostics; nil discards them.
	Logger *slog.Logger
}

// Result is how a run ended.
type Result struct {
	// Done is true when the session ended with a final answer.
	Done bool `json:"done"`
	// Answer is the final answer's text.
	Answer string `json:"answer,omitempty"`
	// Steps is the number of model replies in the session, earlier runs
	// included.
	Steps int `json:"steps"`
	// ModelCalls is the number of HTTP requests this run made to the model,
	// retries included.
	ModelCalls int `json:"model_calls"`
	// ToolCalls is the number of tool calls this run executed.
	ToolCalls int `json:"tool_calls"`
	// Resumed is true when the run continued an existing session file.
	Resumed bool `json:"resumed"`
	// SessionFile is the session file's path.
	SessionFile string `json:"session_file"`
}

// agent is one run.
type agent struct {
	cfg   Config
	log   *slog.Logger
	out   io.Writer // progress lines
	calls int       // HTTP requests made
	tools int       // tool calls executed
}

// Run runs the agent until a final answer, MaxSteps model replies without
// one (an error wrapping ErrMaxSteps), an error, or the end of ctx. The
// Result is filled in whatever the outcome. A session that already ended with
// a final answer returns it at once, without calling the model.
func Run(ctx context.Context, cfg Config) (res Result, err error) {
	res.SessionFile = cfg.SessionFile
	a, err := newAgent(cfg)
	if err != nil {
		return res, err
	}
	cfg = a.cfg
	defer func() { res.ModelCalls, res.ToolCalls = a.calls, a.tools }()

	s, resumed, err := a.openSession()
	res.Resumed = resumed
	if err != nil {
		return res, err
	}

	for {
		st := s.state()
		res.Steps = st.steps
		for _, c := range st.pending {
			if err := a.runTool(ctx, s, st.step, c); err != nil {
				return res, err
			}
		}
		if st.done {
			res.Done, res.Answer = true, st.answer
			return res, nil
		}
		if st.steps >= cfg.MaxSteps {
			return res, fmt.Errorf("mini: %w: %d model replies, and --max-steps is %d; the session %s can be resumed with a higher limit",
				ErrMaxSteps, st.steps, cfg.MaxSteps, cfg.SessionFile)
		}
		raw, m, err := a.complete(ctx, s.messages)
		if err != nil {
			return res, err
		}
		s.messages = append(s.messages, raw)
		if err := s.save(); err != nil {
			return res, err
		}
		step := st.steps + 1
		res.Steps = step
		if text := strings.TrimSpace(contentText(m.Content)); text != "" && len(m.ToolCalls) > 0 {
			a.log.Debug("model says", "step", step, "text", text)
		}
		if len(m.ToolCalls) == 0 {
			fmt.Fprintf(a.out, "step %d: final answer: %s\n", step, firstLine(contentText(m.Content), 160))
		}
	}
}

// openSession resumes the session file (resumed), or starts a new session
// with the prompt when there is none.
func (a *agent) openSession() (s *session, resumed bool, err error) {
	cfg := a.cfg
	s, err = loadSession(cfg.SessionFile)
	switch {
	case err == nil:
		st := s.state()
		a.log.Info("resuming session", "file", cfg.SessionFile, "steps", st.steps, "pending_tool_calls", len(st.pending), "done", st.done)
		ignored := ""
		if strings.TrimSpace(cfg.Prompt) != "" {
			ignored = "; the prompt given is ignored"
			a.log.Info("the session exists: the prompt given is ignored", "file", cfg.SessionFile)
		}
		if st.done {
			fmt.Fprintf(a.out, "session %s already ended with a final answer at step %d%s\n", cfg.SessionFile, st.steps, ignored)
		} else {
			fmt.Fprintf(a.out, "resuming %s after step %d (%d tool calls to run first)%s\n", cfg.SessionFile, st.steps, len(st.pending), ignored)
		}
		if s.model != cfg.Model {
			a.log.Warn("the session was started with another model", "session_model", s.model, "model", cfg.Model)
		}
		if s.workdir != cfg.WorkDir {
			a.log.Warn("the session was started in another working directory", "session_workdir", s.workdir, "workdir", cfg.WorkDir)
		}
		return s, true, nil
	case errors.Is(err, fs.ErrNotExist):
		if strings.TrimSpace(cfg.Prompt) == "" {
			return nil, false, fmt.Errorf("mini: no prompt, and no session to resume at %s", cfg.SessionFile)
		}
		s = &session{path: cfg.SessionFile, model: cfg.Model, workdir: cfg.WorkDir, messages: []json.RawMessage{
			jsonMessage(textMessage{Role: "system", Content: systemPrompt(cfg.WorkDir)}),
			jsonMessage(textMessage{Role: "user", Content: cfg.Prompt}),
		}}
		if err := s.save(); err != nil {
			return nil, false, err
		}
		a.log.Info("new session", "file", cfg.SessionFile, "model", cfg.Model, "workdir", cfg.WorkDir)
		return s, false, nil
	default:
		return nil, false, err
	}
}

// runTool executes one tool call, appends its result and saves the session.
func (a *agent) runTool(ctx context.Context, s *session, step int, c toolCall) error {
	out, label, err := a.callTool(ctx, c.Function.Name, c.Function.Arguments)
	if err != nil {
		return fmt.Errorf("mini: step %d: %s: %w", step, c.Function.Name, err)
	}
	a.tools++
	if label != "" {
		label = " " + label
	}
	fmt.Fprintf(a.out, "step %d: %s%s → %s\n", step, c.Function.Name, label, out.summary)
	s.messages = append(s.messages, jsonMessage(toolMessage{Role: "tool", ToolCallID: c.ID, Content: out.text}))
	return s.save()
}

func newAgent(cfg Config) (*agent, error) {
	if cfg.Endpoint == "" {
		return nil, errors.New("mini: no endpoint: give the OpenAI base URL, e.g. http://127.0.0.1:7070/v1")
	}
	cfg.Endpoint = strings.TrimRight(cfg.Endpoint, "/")
	if cfg.Model == "" {
		return nil, errors.New("mini: no model name")
	}
	if cfg.SessionFile == "" {
		return nil, errors.New("mini: no session file")
	}
	if cfg.MaxSteps < 0 || cfg.CommandTimeout < 0 || cfg.OutputLimit < 0 {
		return nil, errors.New("mini: MaxSteps, CommandTimeout and OutputLimit must not be negative")
	}
	if cfg.MaxSteps == 0 {
		cfg.MaxSteps = DefaultMaxSteps
	}
	if cfg.CommandTimeout == 0 {
		cfg.CommandTimeout = DefaultCommandTimeout
	}
	if cfg.OutputLimit == 0 {
		cfg.OutputLimit = DefaultOutputLimit
	}
	wd := cfg.WorkDir
	if wd == "" {
		wd = "."
	}
	wd, err := filepath.Abs(wd)
	if err != nil {
		return nil, fmt.Errorf("mini: working directory: %w", err)
	}
	if st, err := os.Stat(wd); err != nil {
		return nil, fmt.Errorf("mini: working directory: %w", err)
	} else if !st.IsDir() {
		return nil, fmt.Errorf("mini: working directory %s is not a directory", wd)
	}
	cfg.WorkDir = wd
	if cfg.HTTPClient == nil {
		cfg.HTTPClient = &http.Client{}
	}
	a := &agent{cfg: cfg, log: cfg.Logger, out: cfg.Log}
	if a.log == nil {
		a.log = slog.New(slog.DiscardHandler)
	}
	if a.out == nil {
		a.out = io.Discard
	}
	return a, nil
}

type textMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type toolMessage struct {
	Role       string `json:"role"`
	ToolCallID string `json:"tool_call_id"`
	Content    string `json:"content"`
}

func systemPrompt(workdir string) string {
	return `You are mini, a coding agent. You work in the directory ` + workdir + ` and solve the task the user gives you by calling tools:

- run: run a shell command (/bin/sh -c, in the working directory); you get its exit code and combined output.
- read_file: read a file.
- write_file: create or overwrite a file.
- edit_file: replace exactly one occurrence of a text in a file.

Relative paths are relative to the working directory. Look at the code before you change it, keep changes small, and run the tests after changing something. Nobody answers questions while you work: decide for yourself. When the task is done, reply without a tool call, with a short summary of what you changed.`
}
