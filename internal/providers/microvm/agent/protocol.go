package agent

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"path"
	"slices"
	"strings"
	"time"

	"stasis/errdefs"
	"stasis/sandbox"
)

// Frame kinds of an exec response.
const (
	frameStdout byte = 'o'
	frameStderr byte = 'e'
	frameEnd    byte = 'x'
)

const (
	frameHeaderLen = 5       // kind byte + big-endian uint32 length
	maxFrameData   = 1 << 20 // the most data one frame may carry
	maxHeaderBytes = 1 << 20 // the longest exec header line

	framesType = "application/x-stasis-frames"
	errTrailer = "Stasis-Error"

	// workDir is the default cwd and the base of relative paths.
	workDir = "/work"
	// defaultPath is PATH inside the guest (the local provider's too).
	defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	defaultHome = "/root"
)

// appendFrame appends one frame to b.
func appendFrame(b []byte, kind byte, data []byte) []byte {
	b = append(b, kind)
	b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
	return append(b, data...)
}

// readFrame reads one frame from r into buf (grown as needed) and returns
// its kind and data. It returns io.EOF only when r ends exactly between
// frames.
func readFrame(r io.Reader, buf []byte) (kind byte, data, newBuf []byte, err error) {
	var h [frameHeaderLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, nil, buf, err
	}
	kind = h[0]
	switch kind {
	case frameStdout, frameStderr, frameEnd:
	default:
		return 0, nil, buf, fmt.Errorf("exec stream: unknown frame kind %#x", kind)
	}
	n := binary.BigEndian.Uint32(h[1:])
	if n > maxFrameData {
		return 0, nil, buf, fmt.Errorf("exec stream: frame of %d bytes, the limit is %d", n, maxFrameData)
	}
	if cap(buf) < int(n) {
		buf = make([]byte, n)
	}
	data = buf[:n]
	if _, err := io.ReadFull(r, data); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, buf, err
	}
	return kind, data, buf, nil
}

// wireError is an error as it travels: the kind of sandbox error and its
// message.
type wireError struct {
	Kind    string `json:"kind,omitempty"`
	Message string `json:"error,omitempty"`
}

var kinds = []struct {
	name string
	err  error
}{
	{"not_found", errdefs.ErrNotFound},
	{"invalid", errdefs.ErrInvalid},
	{"timeout", errdefs.ErrTimeout},
	{"unsupported", errdefs.ErrUnsupported},
	{"expired", errdefs.ErrExpired},
	{"wrong_state", errdefs.ErrConflict},
}

// toWire turns an error into its kind and message.
func toWire(err error) wireError {
	msg := err.Error()
	var se *sandbox.Error
	if errors.As(err, &se) {
		msg = se.Msg
	}
	for _, k := range kinds {
		if errors.Is(err, k.err) {
			return wireError{Kind: k.name, Message: msg}
		}
	}
	return wireError{Kind: "internal", Message: msg}
}

// toError turns a wire error back into a sandbox error (a plain error for
// an internal one).
func (e wireError) toError(op, what string) error {
	for _, k := range kinds {
		if e.Kind == k.name {
			return sandbox.Errorf(k.err, op, what, "%s", e.Message)
		}
	}
	if what != "" {
		op += " " + what
	}
	return fmt.Errorf("%s: agent: %s", op, e.Message)
}

// endFrame is the data of the last frame of an exec stream.
type endFrame struct {
	ExitCode int `json:"exit_code"`
	PID      int `json:"pid,omitempty"`
	wireError
}

func parseEnd(data []byte) (endFrame, error) {
	var e endFrame
	if err := json.Unmarshal(data, &e); err != nil {
		return e, fmt.Errorf("exec stream: bad end frame: %v", err)
	}
	return e, nil
}

// execHeader is the first line of an exec request body.
type execHeader struct {
	Argv       []string          `json:"argv"`
	Env        map[string]string `json:"env,omitempty"`
	Cwd        string            `json:"cwd,omitempty"`
	TimeoutMS  int64             `json:"timeout_ms,omitempty"`
	Background bool              `json:"background,omitempty"`
	LogPath    string            `json:"log_path,omitempty"`
	// User is "" (the agent) or "control" (sandbox.UserControl): whom
	// the command runs as where the guest's users are split.
	User string `json:"user,omitempty"`
}

func (h execHeader) timeout() time.Duration { return time.Duration(h.TimeoutMS) * time.Millisecond }

// readHeader reads the header line (newline included) from the start of an
// exec body; what follows in br is the command's stdin.
func readHeader(br *bufio.Reader) ([]byte, error) {
	var line []byte
	for {
		chunk, err := br.ReadSlice('\n')
		line = append(line, chunk...)
		if len(line) > maxHeaderBytes {
			return nil, sandbox.Errorf(errdefs.ErrInvalid, "exec", "", "the header line is longer than %d bytes", maxHeaderBytes)
		}
		switch {
		case err == nil:
			return line, nil
		case err == bufio.ErrBufferFull:
			continue
		case err == io.EOF:
			return nil, sandbox.Errorf(errdefs.ErrInvalid, "exec", "", "the body ended before the header's newline")
		default:
			return nil, err
		}
	}
}

// parseExecHeader decodes and checks a header line, and fills in the
// defaults: cwd is absolute and clean afterwards.
func parseExecHeader(line []byte) (execHeader, error) {
	var h execHeader
	bad := func(format string, args ...any) (execHeader, error) {
		return execHeader{}, sandbox.Errorf(errdefs.ErrInvalid, "exec", "", format, args...)
	}
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&h); err != nil {
		return bad("bad header: %v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return bad("bad header: data after the JSON value")
	}
	if len(h.Argv) == 0 || h.Argv[0] == "" {
		return bad("no command")
	}
	for _, a := range h.Argv {
		if strings.IndexByte(a, 0) >= 0 {
			return bad("an argument holds a NUL byte")
		}
	}
	for k, v := range h.Env {
		if k == "" || strings.ContainsAny(k, "=\x00") || strings.IndexByte(v, 0) >= 0 {
			return bad("bad environment variable %q", k)
		}
	}
	if strings.IndexByte(h.Cwd, 0) >= 0 || strings.IndexByte(h.LogPath, 0) >= 0 {
		return bad("a path holds a NUL byte")
	}
	if h.TimeoutMS < 0 || h.TimeoutMS > math.MaxInt64/int64(time.Millisecond) {
		return bad("timeout_ms %d out of range", h.TimeoutMS)
	}
	if h.User != "" && h.User != string(sandbox.UserControl) {
		return bad("user %q: give \"\" (the agent) or %q", h.User, sandbox.UserControl)
	}
	if len(h.Env) == 0 {
		h.Env = nil
	}
	h.Cwd = absPath(h.Cwd)
	return h, nil
}

// absPath makes a guest path absolute (relative to /work) and clean.
func absPath(p string) string {
	if !path.IsAbs(p) {
		p = path.Join(workDir, p)
	}
	return path.Clean(p)
}

// environ is the command's environment: the base plus the request's,
// sorted by name.
func (h execHeader) environ(home string) []string {
	env := map[string]string{"PATH": defaultPath, "HOME": home}
	for k, v := range h.Env {
		env[k] = v
	}
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	slices.Sort(out)
	return out
}

// Port is the TCP port the guest agent listens on inside the guest.
const Port = 7000
