package harness

import (
	"context"
	"path"

	"stasis/sandbox"
)

// BinaryPath is where the stasis binary is inside a sandbox (the checkpoint
// session places it there); mini is one of its commands. BoundBinaryPath is
// where a provider that binds the host's binary in read-only puts it.
const (
	BinaryPath      = "/tmp/.stasis/bin/stasis"
	BoundBinaryPath = sandbox.BinaryPath
)

// Mini is the adapter of mini, the agent built into stasis: it needs
// nothing installed but the stasis binary, and it saves its conversation in
// Dir/mini-session.json after every step, so its relaunch is the same
// command: mini resumes the session file it finds.
type Mini struct{}

// Name implements Adapter.
func (Mini) Name() string { return "mini" }

// SessionFile is mini's saved conversation for a launch.
func (Mini) SessionFile(l Launch) string { return path.Join(l.Dir, "mini-session.json") }

// Install implements Adapter: mini is part of the stasis binary, which
// Prepare checks for.
func (Mini) Install(context.Context, sandbox.Files, string) error { return nil }

// Prepare implements Adapter: in one exec, check that the stasis binary is
// in place (copied or bound in) and make Dir.
func (m Mini) Prepare(ctx context.Context, p sandbox.Files, id string, l Launch) error {
	bin := l.Stasis
	if bin == "" {
		bin = BinaryPath
	}
	return sh(ctx, p, id, "mini: prepare "+l.Dir,
		`[ -x "$1" ] || { echo "the stasis binary is not at $1: start a checkpoint session first" >&2; exit 1; }; mkdir -p -- "$2"`, bin, l.Dir)
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
func (m Mini) Session(ctx context.Context, p sandbox.Files, id string, l Launch) (string, error) {
	ok, err := exists(ctx, p, id, m.SessionFile(l))
	if err != nil || !ok {
		return "", err
	}
	return m.SessionFile(l), nil
}

// Resume implements Adapter: the same command; mini finds its session file.
func (m Mini) Resume(l Launch, _ string) Command { return m.Start(l) }
