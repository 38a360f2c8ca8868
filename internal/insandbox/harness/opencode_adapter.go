package harness

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"stasis/internal/insandbox/harness/opencode"
	"stasis/sandbox"
)

// OpenCodeSandboxDir is where the OpenCode adapter expects OpenCode inside
// a sandbox: the npm prefix `make deps-opencode` fills, as the local
// provider binds it read-only (local.Options.ReadOnlyBinds), or as Install
// uploads it.
const OpenCodeSandboxDir = "/stasis/opencode"

// OpenCodeBind is the host directory a local sandbox binds read-only at
// OpenCodeSandboxDir to run the OpenCode `make deps-opencode` installed
// (its npm prefix); ok is false when OpenCode is not installed.
func OpenCodeBind() (host string, ok bool) {
	bin, err := opencode.Binary()
	if err != nil {
		return "", false
	}
	prefix, err := opencode.Prefix(bin)
	if err != nil {
		return "", false
	}
	return prefix, true
}

// OpenCode is the adapter of OpenCode (npm opencode-ai): configured offline
// with one provider pointing at the relay, run non-interactively on the
// prompt, with its data directory under Dir so that a file-only snapshot
// keeps its session; a relaunch runs `opencode run --session ID` (or
// --continue) to continue it.
type OpenCode struct {
	// HostBinary is OpenCode on the host, uploaded by Install when the
	// sandbox does not already have it (default: opencode.Binary()).
	HostBinary string
}

// Name implements Adapter.
func (*OpenCode) Name() string { return "opencode" }

// Binary is OpenCode's executable inside the sandbox.
func (*OpenCode) Binary() string { return OpenCodeSandboxDir + "/node_modules/.bin/opencode" }

// Install implements Adapter. When the sandbox does not see OpenCode at
// OpenCodeSandboxDir (a local sandbox made with that directory bound in
// does), it uploads the OpenCode binary and its plugin package there.
func (o *OpenCode) Install(ctx context.Context, p sandbox.Files, id string) error {
	ok, err := exists(ctx, p, id, o.Binary())
	if err != nil {
		return fmt.Errorf("opencode: %w", err)
	}
	if ok {
		return nil
	}
	bin := o.HostBinary
	if bin == "" {
		if bin, err = opencode.Binary(); err != nil {
			return err
		}
	}
	real, err := filepath.EvalSymlinks(bin)
	if err != nil {
		return fmt.Errorf("opencode: %w", err)
	}
	prefix, err := opencode.Prefix(bin)
	if err != nil {
		return err
	}
	nm := filepath.Join(prefix, "node_modules")
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := addFile(tw, real, "node_modules/opencode-ai/bin/opencode", 0o755); err != nil {
		return err
	}
	if err := tw.WriteHeader(&tar.Header{Name: "node_modules/.bin/opencode", Typeflag: tar.TypeSymlink, Linkname: "../opencode-ai/bin/opencode", Mode: 0o777}); err != nil {
		return err
	}
	plugin := filepath.Join(nm, "@opencode-ai", "plugin")
	if _, err := os.Stat(plugin); err == nil {
		if err := filepath.Walk(plugin, func(f string, info os.FileInfo, err error) error {
			if err != nil || !info.Mode().IsRegular() {
				return err
			}
			rel, _ := filepath.Rel(nm, f)
			return addFile(tw, f, "node_modules/"+filepath.ToSlash(rel), info.Mode().Perm())
		}); err != nil {
			return fmt.Errorf("opencode: %w", err)
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := p.Upload(ctx, id, OpenCodeSandboxDir, &buf); err != nil {
		return fmt.Errorf("opencode: upload OpenCode into sandbox %s: %w", id, err)
	}
	return nil
}

func addFile(tw *tar.Writer, src, name string, mode os.FileMode) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if err := tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Size: st.Size(), Mode: int64(mode)}); err != nil {
		return err
	}
	_, err = io.Copy(tw, f)
	return err
}

// Prepare implements Adapter: opencode.json with the relay as the only
// provider, and the plugin package linked into the config directory so
// OpenCode installs nothing.
func (o *OpenCode) Prepare(ctx context.Context, p sandbox.Files, id string, l Launch) error {
	cfg, err := opencode.Config(l.ModelURL, l.Model)
	if err != nil {
		return err
	}
	files, err := opencode.ConfigFiles(l.Dir, cfg)
	if err != nil {
		return err
	}
	for name, b := range files {
		if err := p.WriteFile(ctx, id, name, b, 0o644); err != nil {
			return fmt.Errorf("opencode: write %s in sandbox %s: %w", name, id, err)
		}
	}
	link := opencode.PluginLink(l.Dir)
	return sh(ctx, p, id, "opencode: link its plugin package",
		`if [ -d "$1/@opencode-ai/plugin" ]; then mkdir -p -- "$(dirname -- "$2")" && rm -f -- "$2" && ln -s -- "$1" "$2"; fi`,
		OpenCodeSandboxDir+"/node_modules", link)
}

func (o *OpenCode) env(l Launch) map[string]string {
	env := map[string]string{}
	for _, kv := range opencode.Env(l.Dir) {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	return env
}

// Start implements Adapter.
func (o *OpenCode) Start(l Launch) Command {
	a := opencode.Argv(o.Binary(), l.WorkDir, l.Prompt)
	env := o.env(l)
	return Command{Argv: a, Env: env, ResumeCmd: envPrefix(env) + ShellQuote([]string{"/bin/sh", "-c", o.resumeLatest(l)})}
}

// ResumePrompt is the message a relaunched OpenCode gets after its saved
// conversation.
const ResumePrompt = "You were interrupted. Continue the task from where you stopped."

func (o *OpenCode) resumeArgv(l Launch, session string) []string {
	a := []string{o.Binary(), "run", "--pure", "--dir", l.WorkDir}
	if session != "" {
		a = append(a, "--session", session)
	} else {
		a = append(a, "--continue")
	}
	return append(a, "--", ResumePrompt)
}

// resumeLatest is a shell command that continues the newest session
// OpenCode saved for the work tree when that session holds the task: its
// first message, with the task's text. Otherwise it starts the task
// afresh. OpenCode writes a new session and its first message in separate
// transactions, so a pause can come between them: a session with no
// message, which `opencode run --session` would continue on the resume
// message alone, without the task, and the episode would end unresolved.
// When the session list cannot be read, it continues the newest session
// (OpenCode then says what is wrong); when the session cannot be exported,
// it continues that session.
func (o *OpenCode) resumeLatest(l Launch) string {
	list := ShellQuote([]string{o.Binary(), "session", "list", "--format", "json", "-n", "1"})
	export := ShellQuote([]string{o.Binary(), "export"})
	continueID := ShellQuote([]string{o.Binary(), "run", "--pure", "--dir", l.WorkDir, "--session"}) + ` "$id" -- ` + ShellQuote([]string{ResumePrompt})
	afresh := ShellQuote(opencode.Argv(o.Binary(), l.WorkDir, l.Prompt))
	return "cd " + ShellQuote([]string{l.WorkDir}) + " || exit 127\n" +
		"s=$(" + list + " 2>/dev/null) || exec " + ShellQuote(o.resumeArgv(l, "")) + "\n" +
		"case $s in *'\"id\"'*) ;; *) exec " + afresh + " ;; esac\n" +
		// The first id in the list: what follows "id", between the next two quotes.
		"id=${s#*'\"id\"'}; id=${id#*'\"'}; id=${id%%'\"'*}\n" +
		"e=$(" + export + ` "$id" 2>/dev/null) || exec ` + continueID + "\n" +
		"case $e in *'\"type\": \"text\"'*|*'\"type\":\"text\"'*) exec " + continueID + " ;; esac\n" +
		"exec " + afresh + "\n"
}

// Resume implements Adapter: `opencode run --session ID` on the session
// Session named; for "" (none was found at the pause), the newest saved
// session, or the task afresh when there is none (resumeLatest).
func (o *OpenCode) Resume(l Launch, session string) Command {
	env := o.env(l)
	if session == "" {
		a := []string{"/bin/sh", "-c", o.resumeLatest(l)}
		return Command{Argv: a, Env: env, ResumeCmd: envPrefix(env) + ShellQuote(a)}
	}
	a := o.resumeArgv(l, session)
	return Command{Argv: a, Env: env, ResumeCmd: envPrefix(env) + ShellQuote(a)}
}

// Session implements Adapter: the newest session OpenCode has saved for
// the work tree (`opencode session list --format json`).
func (o *OpenCode) Session(ctx context.Context, p sandbox.Files, id string, l Launch) (string, error) {
	var out, errb bytes.Buffer
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{
		Argv: []string{o.Binary(), "session", "list", "--format", "json", "-n", "1"},
		Cwd:  l.WorkDir, Env: o.env(l), Stdout: &out, Stderr: &errb,
	})
	if err != nil {
		return "", fmt.Errorf("opencode: list sessions: %w", err)
	}
	if res.ExitCode != 0 {
		return "", fmt.Errorf("opencode: session list exited %d: %s", res.ExitCode, strings.TrimSpace(errb.String()))
	}
	return parseSessionList(out.Bytes())
}

// parseSessionList takes the id of the first session `opencode session
// list --format json` prints; "" when there is none.
func parseSessionList(b []byte) (string, error) {
	b = bytes.TrimSpace(b)
	if len(b) == 0 {
		return "", nil
	}
	var list []struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal(b, &list); err != nil {
		return "", fmt.Errorf("opencode: session list: %w: %.200q", err, b)
	}
	if len(list) == 0 {
		return "", nil
	}
	if list[0].ID == "" {
		return "", errors.New("opencode: session list: a session without an id")
	}
	return list[0].ID, nil
}
