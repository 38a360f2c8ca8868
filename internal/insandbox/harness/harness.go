// Package harness owns the harness adapters: for each agent harness stasis
// runs (OpenCode, and mini, the agent built into stasis), how it is made
// runnable in a sandbox, how it is launched on a task under the supervisor
// with the relay as its model endpoint, how its session is named, and how a
// relaunch continues that session.
//
// Adapters write and run only inside the sandbox, through the provider, so
// they work on every provider; the supervisor launches the commands they
// return.
package harness

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"stasis/sandbox"
)

// Launch is what an adapter needs to know about one episode.
type Launch struct {
	Episode string
	// Prompt is the task as the harness is asked it.
	Prompt string
	// WorkDir is the task's work tree inside the sandbox.
	WorkDir string
	// Dir is the harness's own directory inside the sandbox: its
	// configuration and saved session live there, so a file-only snapshot
	// keeps them. It must be inside a place snapshots keep (the local
	// provider keeps /work, /tmp and $HOME).
	Dir string
	// ModelURL is the relay's OpenAI-compatible base URL as the harness
	// reaches it inside the sandbox (http://127.0.0.1:PORT/v1).
	ModelURL string
	Model    string
	// Stasis is the stasis binary inside the sandbox (default BinaryPath).
	Stasis string
}

// Command is a harness command for the supervisor to launch.
type Command struct {
	Argv []string
	// Env is added to the supervisor's (and so the harness's) environment.
	Env map[string]string
	// ResumeCmd is the shell command the supervisor runs to relaunch the
	// harness after a stop pause it could not confirm.
	ResumeCmd string
}

// Adapter launches and resumes one kind of harness.
type Adapter interface {
	// Name is the harness's name in records and on the command line.
	Name() string
	// Install makes the harness runnable in the sandbox (idempotent).
	Install(ctx context.Context, p sandbox.Files, sandboxID string) error
	// Prepare writes the harness's configuration for the episode into
	// l.Dir.
	Prepare(ctx context.Context, p sandbox.Files, sandboxID string, l Launch) error
	// Start is the command that launches the harness afresh on the task.
	Start(l Launch) Command
	// Session names the harness's saved session in the sandbox, or "" when
	// it has none yet.
	Session(ctx context.Context, p sandbox.Files, sandboxID string, l Launch) (string, error)
	// Resume is the command that relaunches the harness and continues its
	// saved session (session as Session named it; "" for the latest).
	Resume(l Launch, session string) Command
}

// Names lists the adapters New knows.
func Names() []string { return []string{"mini", "opencode"} }

// New returns the adapter for a harness name.
func New(name string) (Adapter, error) {
	switch name {
	case "mini":
		return Mini{}, nil
	case "opencode":
		return &OpenCode{}, nil
	}
	return nil, fmt.Errorf("no harness %q; the harnesses are %s", name, strings.Join(Names(), ", "))
}

// ShellQuote quotes argv for /bin/sh.
func ShellQuote(argv []string) string {
	q := make([]string, len(argv))
	for i, a := range argv {
		if a != "" && strings.Trim(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:@,+") == "" {
			q[i] = a
			continue
		}
		q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return strings.Join(q, " ")
}

// envPrefix renders env as `env K=V ...` for a shell command, sorted.
func envPrefix(env map[string]string) string {
	if len(env) == 0 {
		return ""
	}
	keys := make([]string, 0, len(env))
	for k := range env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := []string{"env"}
	for _, k := range keys {
		parts = append(parts, k+"="+env[k])
	}
	return ShellQuote(parts) + " "
}

// exists reports whether a path exists inside the sandbox.
func exists(ctx context.Context, p sandbox.Files, id, file string) (bool, error) {
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"test", "-e", file}})
	if err != nil {
		return false, err
	}
	return res.ExitCode == 0, nil
}

// sh runs a shell script in the sandbox and reports a failure with its
// output.
func sh(ctx context.Context, p sandbox.Files, id, what, script string, args ...string) error {
	var out strings.Builder
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{
		Argv: append([]string{"/bin/sh", "-c", script, "sh"}, args...), Stdout: &out, Stderr: &out,
	})
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("%s: exit %d: %s", what, res.ExitCode, strings.TrimSpace(out.String()))
	}
	return nil
}
