package harness

import (
	"context"
	"fmt"

	"stasis/sandbox"
)

// BinaryPath is where the stasis binary is inside a sandbox (the checkpoint
// session places it there); mini is one of its commands. BoundBinaryPath is
// where a provider that binds the host's binary in read-only puts it.
const (
	BinaryPath      = "/tmp/.stasis/bin/stasis"
	BoundBinaryPath = "/stasis/bin/stasis"
)

// Mini is the adapter of mini, the agent built into stasis: it needs
// nothing installed but the stasis binary, and it saves its conversation in
// Dir/mini-session.json after every step, so its relaunch is the same
// command: mini resumes the session file it finds.
type Mini struct{}

// Name implements Adapter.
func (Mini) Name() string { return "mini" }

// SessionFile is mini's saved conversation for a launch.
func (Mini) SessionFile(l Launch) string { return join(l.Dir, "mini-session.json") }

// Install implements Adapter: the stasis binary must be in place, copied
// or bound in.
func (Mini) Install(ctx context.Context, p sandbox.Provider, id string) error {
	for _, b := range []string{BoundBinaryPath, BinaryPath} {
		ok, err := exists(ctx, p, id, b)
		if err != nil {
			return fmt.Errorf("mini: %w", err)
		}
		if ok {
			return nil
		}
	}
	return fmt.Errorf("mini: the stasis binary is neither at %s nor at %s in sandbox %s: start a checkpoint session there first", BoundBinaryPath, BinaryPath, id)
}

// Prepare implements Adapter.
func (Mini) Prepare(ctx context.Context, p sandbox.Provider, id string, l Launch) error {
	return sh(ctx, p, id, "mini: make "+l.Dir, `mkdir -p -- "$1"`, l.Dir)
}

func (m Mini) argv(l Launch) []string {
	bin := l.Stasis
	if bin == "" {
		bin = BinaryPath
	}
	return []string{bin, "mini", "--endpoint", l.ModelURL, "--model", l.Model,
		"--workdir", l.WorkDir, "--session", m.SessionFile(l), "--", l.Prompt}
}

// Start implements Adapter.
func (m Mini) Start(l Launch) Command {
	a := m.argv(l)
	return Command{Argv: a, ResumeCmd: ShellQuote(a)}
}

// Session implements Adapter: the session file, once mini has written it.
func (m Mini) Session(ctx context.Context, p sandbox.Provider, id string, l Launch) (string, error) {
	ok, err := exists(ctx, p, id, m.SessionFile(l))
	if err != nil || !ok {
		return "", err
	}
	return m.SessionFile(l), nil
}

// Resume implements Adapter: the same command; mini finds its session file.
func (m Mini) Resume(l Launch, _ string) Command { return m.Start(l) }
