package mini

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// toolsJSON is the "tools" array of every request: the four tools with their
// JSON-schema parameters. It is a constant so that a relaunched agent offers
// byte-identical tools.
var toolsJSON = mustCompact(`[
  {"type": "function", "function": {
    "name": "run",
    "description": "Run a shell command with /bin/sh -c in the working directory. Returns the exit code and the combined stdout and stderr (long output is cut in the middle). Stdin is empty; the command is killed with its process group when it runs out of time.",
    "parameters": {"type": "object", "properties": {
      "command": {"type": "string", "description": "The shell command, e.g. \"go test ./...\"."}
    }, "required": ["command"]}}},
  {"type": "function", "function": {
    "name": "read_file",
    "description": "Read a text file and return its content. Long files are cut; use run with sed -n to read a part.",
    "parameters": {"type": "object", "properties": {
      "path": {"type": "string", "description": "The file, absolute or relative to the working directory."}
    }, "required": ["path"]}}},
  {"type": "function", "function": {
    "name": "write_file",
    "description": "Create or overwrite a file with the given content; missing parent directories are created.",
    "parameters": {"type": "object", "properties": {
      "path": {"type": "string", "description": "The file, absolute or relative to the working directory."},
      "content": {"type": "string", "description": "The whole new content of the file."}
    }, "required": ["path", "content"]}}},
  {"type": "function", "function": {
    "name": "edit_file",
    "description": "Replace exactly one occurrence of old with new in a file. It fails, changing nothing, when old does not occur or occurs more than once: then copy the text exactly, with enough surrounding lines to be unique.",
    "parameters": {"type": "object", "properties": {
      "path": {"type": "string", "description": "The file, absolute or relative to the working directory."},
      "old": {"type": "string", "description": "The exact text to replace, whitespace included."},
      "new": {"type": "string", "description": "The text to put in its place."}
    }, "required": ["path", "old", "new"]}}}
]`)

// ToolNames are the tools mini offers, in the order of the request.
var ToolNames = []string{"run", "read_file", "write_file", "edit_file"}

func mustCompact(s string) []byte {
	var b bytes.Buffer
	if err := json.Compact(&b, []byte(s)); err != nil {
		panic("mini: tools JSON: " + err.Error())
	}
	return b.Bytes()
}

// toolOutcome is what a tool call gives: the text of the tool message and a
// short summary for the progress line.
type toolOutcome struct {
	text    string
	summary string
}

func toolFailed(format string, a ...any) toolOutcome {
	msg := fmt.Sprintf(format, a...)
	return toolOutcome{text: "error: " + msg, summary: "error: " + firstLine(msg, 100)}
}

// callTool runs one tool call. Failures of the tool, unknown tools and
// malformed arguments become the result text; the error is only for what
// ends the run (the context).
func (a *agent) callTool(ctx context.Context, name string, rawArgs json.RawMessage) (toolOutcome, string, error) {
	switch name {
	case "run":
		var args struct {
			Command *string `json:"command"`
		}
		if err := decodeArgs(rawArgs, &args); err != nil {
			return toolFailed("run: %v", err), "", nil
		}
		if args.Command == nil || strings.TrimSpace(*args.Command) == "" {
			return toolFailed(`run: "command" is missing or empty: give the shell command to run`), "", nil
		}
		out, err := a.runCommand(ctx, *args.Command)
		return out, "`" + firstLine(*args.Command, 80) + "`", err
	case "read_file":
		var args struct {
			Path *string `json:"path"`
		}
		if err := decodeArgs(rawArgs, &args); err != nil {
			return toolFailed("read_file: %v", err), "", nil
		}
		if args.Path == nil || *args.Path == "" {
			return toolFailed(`read_file: "path" is missing or empty`), "", nil
		}
		return a.readFile(*args.Path), *args.Path, nil
	case "write_file":
		var args struct {
			Path    *string `json:"path"`
			Content *string `json:"content"`
		}
		if err := decodeArgs(rawArgs, &args); err != nil {
			return toolFailed("write_file: %v", err), "", nil
		}
		if args.Path == nil || *args.Path == "" {
			return toolFailed(`write_file: "path" is missing or empty`), "", nil
		}
		if args.Content == nil {
			return toolFailed(`write_file: "content" is missing (give "" for an empty file)`), *args.Path, nil
		}
		return a.writeFile(*args.Path, *args.Content), *args.Path, nil
	case "edit_file":
		var args struct {
			Path *string `json:"path"`
			Old  *string `json:"old"`
			New  *string `json:"new"`
		}
		if err := decodeArgs(rawArgs, &args); err != nil {
			return toolFailed("edit_file: %v", err), "", nil
		}
		if args.Path == nil || *args.Path == "" {
			return toolFailed(`edit_file: "path" is missing or empty`), "", nil
		}
		if args.Old == nil || *args.Old == "" {
			return toolFailed(`edit_file: "old" is missing or empty: give the exact text to replace`), *args.Path, nil
		}
		if args.New == nil {
			return toolFailed(`edit_file: "new" is missing (give "" to delete the text)`), *args.Path, nil
		}
		return a.editFile(*args.Path, *args.Old, *args.New), *args.Path, nil
	}
	return toolFailed("there is no tool %q: the tools are %s", name, strings.Join(ToolNames, ", ")), "", nil
}

// decodeArgs decodes a tool call's arguments: JSON text in a string (the
// OpenAI form) or, from lenient servers, a JSON object. Unknown fields are
// ignored.
func decodeArgs(raw json.RawMessage, v any) error {
	raw = bytes.TrimSpace(raw)
	if len(raw) > 0 && raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return fmt.Errorf("the arguments are not valid JSON: %v", err)
		}
		raw = bytes.TrimSpace([]byte(s))
	}
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		raw = []byte("{}")
	}
	if raw[0] != '{' {
		return fmt.Errorf("the arguments must be a JSON object, got %.60q", raw)
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return fmt.Errorf("the arguments are not valid: %v", err)
	}
	return nil
}

// path resolves a tool's path against the working directory.
func (a *agent) path(p string) string {
	if filepath.IsAbs(p) {
		return filepath.Clean(p)
	}
	return filepath.Join(a.cfg.WorkDir, p)
}

// runCommand runs command with /bin/sh -c in the working directory, in its
// own process group, which is killed at the command timeout or when ctx
// ends. Processes it leaves in the background keep running; their output
// after the shell exits is not collected.
func (a *agent) runCommand(ctx context.Context, command string) (toolOutcome, error) {
	cctx, cancel := context.WithTimeout(ctx, a.cfg.CommandTimeout)
	defer cancel()
	cmd := exec.CommandContext(cctx, "/bin/sh", "-c", command)
	cmd.Dir = a.cfg.WorkDir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	// Background processes may hold the output pipe open: stop reading it
	// this long after the shell has exited.
	cmd.WaitDelay = 2 * time.Second
	out := newHeadTail(a.cfg.OutputLimit)
	cmd.Stdout, cmd.Stderr = out, out
	start := time.Now()
	err := cmd.Run()
	if ctx.Err() != nil {
		return toolOutcome{}, ctx.Err()
	}
	var note, summary string
	code := -1
	var ee *exec.ExitError
	switch {
	case errors.Is(cctx.Err(), context.DeadlineExceeded):
		note = fmt.Sprintf("timed out after %s: the command and its process group were killed", a.cfg.CommandTimeout)
		summary = "timed out after " + a.cfg.CommandTimeout.String()
	case err == nil || errors.Is(err, exec.ErrWaitDelay):
		code = cmd.ProcessState.ExitCode()
		if err != nil {
			note = "processes left in the background kept the output open; their later output is not shown"
		}
	case errors.As(err, &ee):
		code = ee.ExitCode()
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			note = "killed by signal " + ws.Signal().String()
			summary = "signal " + ws.Signal().String()
		}
	default:
		return toolFailed("run: %v", err), nil
	}
	if summary == "" {
		summary = fmt.Sprintf("exit %d", code)
	}
	a.log.Debug("command done", "command", command, "exit", code, "took", time.Since(start), "output_bytes", out.total)
	var b strings.Builder
	fmt.Fprintf(&b, "exit code: %d\n", code)
	if note != "" {
		b.WriteString(note + "\n")
	}
	if out.total == 0 {
		b.WriteString("(no output)")
	} else {
		b.WriteString(out.String())
	}
	return toolOutcome{text: b.String(), summary: summary}, nil
}

func (a *agent) readFile(p string) toolOutcome {
	full := a.path(p)
	st, err := os.Stat(full)
	if err != nil {
		return toolFailed("read_file: %v", err)
	}
	if st.IsDir() {
		return toolFailed("read_file: %s is a directory: list it with run (ls)", p)
	}
	b, err := os.ReadFile(full)
	if err != nil {
		return toolFailed("read_file: %v", err)
	}
	limit := a.cfg.OutputLimit
	if len(b) > limit {
		text := string(b[:limit]) + fmt.Sprintf("\n[truncated: the first %d of %d bytes are shown; read the rest with run, e.g. tail -c +%d %s | head -c %d]",
			limit, len(b), limit+1, shellQuote(p), limit)
		return toolOutcome{text: text, summary: fmt.Sprintf("%d bytes (truncated)", len(b))}
	}
	if len(b) == 0 {
		return toolOutcome{text: "(the file is empty)", summary: "0 bytes"}
	}
	return toolOutcome{text: string(b), summary: fmt.Sprintf("%d bytes", len(b))}
}

func (a *agent) writeFile(p, content string) toolOutcome {
	full := a.path(p)
	if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
		return toolFailed("write_file: %v", err)
	}
	// os.WriteFile keeps the mode of a file that exists.
	if err := os.WriteFile(full, []byte(content), 0o644); err != nil {
		return toolFailed("write_file: %v", err)
	}
	return toolOutcome{text: fmt.Sprintf("wrote %d bytes to %s", len(content), p), summary: fmt.Sprintf("%d bytes", len(content))}
}

func (a *agent) editFile(p, old, repl string) toolOutcome {
	full := a.path(p)
	b, err := os.ReadFile(full)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return toolFailed("edit_file: %s does not exist: create it with write_file", p)
		}
		return toolFailed("edit_file: %v", err)
	}
	content := string(b)
	switch n := strings.Count(content, old); n {
	case 0:
		return toolFailed("edit_file: the old text was not found in %s; nothing changed. Read the file and copy the text exactly, whitespace and indentation included", p)
	case 1:
	default:
		return toolFailed("edit_file: the old text occurs %d times in %s; nothing changed. Include more of the surrounding lines so that it occurs exactly once", n, p)
	}
	if err := os.WriteFile(full, []byte(strings.Replace(content, old, repl, 1)), 0o644); err != nil {
		return toolFailed("edit_file: %v", err)
	}
	return toolOutcome{text: "replaced 1 occurrence in " + p, summary: "replaced 1 occurrence"}
}

// headTail keeps the first and the last bytes of what is written to it, up
// to limit in all, and counts the rest.
type headTail struct {
	limit      int
	head, tail []byte // tail is a ring of at most limit-limit/2 bytes once full
	pos        int    // next write position in tail
	total      int
}

func newHeadTail(limit int) *headTail { return &headTail{limit: limit} }

func (h *headTail) Write(p []byte) (int, error) {
	n := len(p)
	h.total += n
	if room := h.limit/2 - len(h.head); room > 0 {
		k := min(room, len(p))
		h.head = append(h.head, p[:k]...)
		p = p[k:]
	}
	tailCap := h.limit - h.limit/2
	for len(p) > 0 && tailCap > 0 {
		if len(h.tail) < tailCap {
			k := min(tailCap-len(h.tail), len(p))
			h.tail = append(h.tail, p[:k]...)
			p = p[k:]
			continue
		}
		k := copy(h.tail[h.pos:], p)
		h.pos = (h.pos + k) % tailCap
		p = p[k:]
	}
	return n, nil
}

// String is the output kept, with a note where bytes were left out.
func (h *headTail) String() string {
	tail := append(append([]byte(nil), h.tail[h.pos:]...), h.tail[:h.pos]...)
	kept := len(h.head) + len(tail)
	if kept == h.total {
		return string(h.head) + string(tail)
	}
	return fmt.Sprintf("%s\n[... %d bytes of output left out: the first %d and the last %d of %d are shown ...]\n%s",
		h.head, h.total-kept, len(h.head), len(tail), h.total, tail)
}

func firstLine(s string, max int) string {
	s = strings.TrimSpace(s)
	cut := false
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s, cut = s[:i], true
	}
	if r := []rune(s); len(r) > max {
		s, cut = string(r[:max]), true
	}
	if cut {
		s += "…"
	}
	return s
}

func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
