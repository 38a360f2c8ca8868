package sim

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"

	"mvdan.cc/sh/v3/expand"
	"mvdan.cc/sh/v3/interp"
	"mvdan.cc/sh/v3/syntax"

	"stasis/errdefs"
	"stasis/sandbox"
)

// home is HOME in a simulated sandbox.
const home = "/root"

// Exec implements sandbox.Files. A foreground command is a shell (sh -c,
// interpreted over the sandbox's files), one of the file utilities, or an
// in-sandbox stasis command; in the background only `stasis supervise`
// runs. Anything else exits 127, as a program that is not there.
func (p *Provider) Exec(ctx context.Context, id string, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	if len(req.Argv) == 0 {
		return sandbox.ExecResult{}, sandbox.Errorf(errdefs.ErrInvalid, "exec", "sandbox "+id, "no command")
	}
	b, err := p.get("exec", id)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	if req.Background {
		if !b.isStasis(req.Argv[0]) || len(req.Argv) < 2 || req.Argv[1] != "supervise" {
			return sandbox.ExecResult{}, sandbox.Errorf(errdefs.ErrUnsupported, "exec", "sandbox "+id, "%q in the background: a simulated sandbox runs no program; only stasis supervise runs there, simulated", req.Argv[0])
		}
		var errb bytes.Buffer
		code, pid := b.stasisCmd(ctx, req.Argv[1:], true, io.Discard, &errb)
		if code != 0 {
			return sandbox.ExecResult{}, sandbox.Errorf(errdefs.ErrInvalid, "exec", "sandbox "+id, "stasis supervise: %s", strings.TrimSpace(errb.String()))
		}
		if req.LogPath != "" {
			b.writeLog(clean("/work", req.LogPath), fmt.Sprintf("{\"msg\":\"supervisor started (simulated)\",\"pid\":%d}\n", pid))
		}
		return sandbox.ExecResult{PID: pid}, nil
	}
	if req.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, req.Timeout)
		defer cancel()
	}
	stdin, stdout, stderr := req.Stdin, req.Stdout, req.Stderr
	if stdin == nil {
		stdin = strings.NewReader("")
	}
	if stdout == nil {
		stdout = io.Discard
	}
	if stderr == nil {
		stderr = io.Discard
	}
	env := map[string]string{"HOME": home, "PATH": "/usr/bin:/bin", "USER": "root"}
	b.mu.Lock()
	for k, v := range b.env {
		env[k] = v
	}
	b.mu.Unlock()
	for k, v := range req.Env {
		env[k] = v
	}
	cwd := "/work"
	if req.Cwd != "" {
		cwd = clean("/work", req.Cwd)
	}
	code := b.run(ctx, req.Argv, env, cwd, stdin, stdout, stderr)
	if err := ctx.Err(); errors.Is(err, context.DeadlineExceeded) && req.Timeout > 0 {
		return sandbox.ExecResult{}, sandbox.Errorf(errdefs.ErrTimeout, "exec", "sandbox "+id, "%q ran past its timeout of %s and was stopped", req.Argv[0], req.Timeout)
	}
	if b.isDead() {
		return sandbox.ExecResult{}, sandbox.Errorf(errdefs.ErrNotFound, "exec", "sandbox "+id, "the sandbox was deleted while the command ran")
	}
	return sandbox.ExecResult{ExitCode: code}, nil
}

func (b *box) isDead() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.dead
}

func (b *box) writeLog(name, line string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	if b.dead || b.fs.mkdirAll(path.Dir(name), 0o755, now) != nil {
		return
	}
	old, _ := b.fs.read(name)
	_ = b.fs.write(name, append(old, line...), 0o644, now)
}

// run runs one command and returns its exit status.
func (b *box) run(ctx context.Context, argv []string, env map[string]string, cwd string, stdin io.Reader, stdout, stderr io.Writer) int {
	if ctx.Err() != nil {
		return 130
	}
	name := argv[0]
	if b.isStasis(name) {
		code, _ := b.stasisCmd(ctx, argv[1:], false, stdout, stderr)
		return code
	}
	switch path.Base(name) {
	case "sh", "bash", "dash":
		return b.shell(ctx, argv[1:], env, cwd, stdin, stdout, stderr)
	}
	if u, ok := utilities[path.Base(name)]; ok && (!strings.Contains(name, "/") || strings.HasPrefix(name, "/bin/") || strings.HasPrefix(name, "/usr/bin/")) {
		return u(ctx, b, argv[1:], cwd, stdin, stdout, stderr)
	}
	fmt.Fprintf(stderr, "%s: not found (a simulated sandbox runs no program: only sh, %s and the in-sandbox stasis commands)\n", name, strings.Join(utilityNames(), ", "))
	return 127
}

// shell is `sh -c SCRIPT [NAME [ARGS...]]`, interpreted over the
// sandbox's files: its commands are run, its redirections opened and its
// tests answered by the sandbox.
func (b *box) shell(ctx context.Context, args []string, env map[string]string, cwd string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) < 1 || args[0] != "-c" || len(args) < 2 {
		fmt.Fprintln(stderr, "sh: a simulated sandbox runs scripts given with -c only")
		return 2
	}
	prog, err := syntax.NewParser().Parse(strings.NewReader(args[1]), "sh")
	if err != nil {
		fmt.Fprintf(stderr, "sh: %v\n", err)
		return 2
	}
	pairs := make([]string, 0, len(env))
	for k, v := range env {
		pairs = append(pairs, k+"="+v)
	}
	sort.Strings(pairs)
	params := []string{"--"}
	if len(args) > 3 {
		params = append(params, args[3:]...)
	}
	r, err := interp.New(
		interp.Env(expand.ListEnviron(pairs...)),
		interp.StdIO(stdin, stdout, stderr),
		interp.Params(params...),
		interp.ExecHandlers(func(interp.ExecHandlerFunc) interp.ExecHandlerFunc {
			return func(ctx context.Context, argv []string) error {
				hc := interp.HandlerCtx(ctx)
				cenv := map[string]string{}
				hc.Env.Each(func(name string, vr expand.Variable) bool {
					if vr.Exported {
						cenv[name] = vr.String()
					}
					return true
				})
				if code := b.run(ctx, argv, cenv, hc.Dir, hc.Stdin, hc.Stdout, hc.Stderr); code != 0 {
					return interp.ExitStatus(uint8(code))
				}
				return nil
			}
		}),
		interp.OpenHandler(b.open),
		interp.StatHandler(b.stat),
		interp.AccessHandler(b.access),
		interp.ReadDirHandler2(b.readDir),
	)
	if err != nil {
		fmt.Fprintf(stderr, "sh: %v\n", err)
		return 2
	}
	r.Dir = cwd
	err = r.Run(ctx, prog)
	var code interp.ExitStatus
	if errors.As(err, &code) {
		return int(code)
	}
	if err != nil {
		fmt.Fprintf(stderr, "sh: %v\n", err)
		return 2
	}
	return 0
}

// open is the shell's redirections over the sandbox's files.
func (b *box) open(ctx context.Context, name string, flag int, perm os.FileMode) (io.ReadWriteCloser, error) {
	if name == "/dev/null" {
		return discard{}, nil
	}
	hc := interp.HandlerCtx(ctx)
	p := clean(hc.Dir, name)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dead {
		return nil, pathErr("open", p, fs.ErrNotExist)
	}
	e, exists := b.fs[p]
	if exists && e.isDir() {
		return nil, pathErr("open", p, errors.New("is a directory"))
	}
	if flag&(os.O_WRONLY|os.O_RDWR) == 0 {
		if !exists {
			return nil, pathErr("open", p, fs.ErrNotExist)
		}
		return &openFile{r: bytes.NewReader([]byte(e.data.Value()))}, nil
	}
	if !exists && flag&os.O_CREATE == 0 {
		return nil, pathErr("open", p, fs.ErrNotExist)
	}
	if err := b.fs.parentOK(p); err != nil {
		return nil, err
	}
	mode := perm
	if exists {
		mode = e.mode
	}
	var prefix []byte
	if exists && flag&os.O_APPEND != 0 {
		prefix = []byte(e.data.Value())
	}
	if !exists || flag&os.O_TRUNC != 0 {
		_ = b.fs.write(p, nil, mode, time.Now()) // the file exists (empty) from the open on
	}
	o := &openFile{w: bytes.NewBuffer(prefix)}
	o.commit = func(data []byte) error {
		b.mu.Lock()
		defer b.mu.Unlock()
		if b.dead {
			return nil
		}
		return b.fs.write(p, data, mode, time.Now())
	}
	return o, nil
}

func (b *box) stat(ctx context.Context, name string, _ bool) (fs.FileInfo, error) {
	hc := interp.HandlerCtx(ctx)
	p := clean(hc.Dir, name)
	b.mu.Lock()
	defer b.mu.Unlock()
	e, ok := b.fs[p]
	if !ok || b.dead {
		return nil, pathErr("stat", p, fs.ErrNotExist)
	}
	return fileInfo{name: path.Base(p), e: e}, nil
}

// access answers -r, -w and -x: one user, root, who may read and write
// everything and execute what has an execute bit.
func (b *box) access(ctx context.Context, p string, mode interp.AccessMode) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	e, ok := b.fs[clean("/", p)]
	switch {
	case !ok || b.dead:
		return pathErr("access", p, fs.ErrNotExist)
	case mode&interp.AccessExec != 0 && !e.isDir() && e.mode&0o111 == 0:
		return pathErr("access", p, fs.ErrPermission)
	}
	return nil
}

func (b *box) readDir(ctx context.Context, name string) ([]fs.DirEntry, error) {
	hc := interp.HandlerCtx(ctx)
	p := clean(hc.Dir, name)
	b.mu.Lock()
	defer b.mu.Unlock()
	e, ok := b.fs[p]
	if !ok || !e.isDir() || b.dead {
		return nil, pathErr("readdir", p, fs.ErrNotExist)
	}
	var out []fs.DirEntry
	for _, c := range b.fs.children(p) {
		out = append(out, fs.FileInfoToDirEntry(fileInfo{name: c, e: b.fs[path.Join(p, c)]}))
	}
	return out, nil
}

// utility is one of the few programs a simulated sandbox has.
type utility func(ctx context.Context, b *box, args []string, cwd string, stdin io.Reader, stdout, stderr io.Writer) int

var utilities map[string]utility

func init() {
	utilities = map[string]utility{
		"cat": catU, "mkdir": mkdirU, "rm": rmU, "mv": mvU, "chmod": chmodU, "stat": statU, "sleep": sleepU, "touch": touchU,
		"true":  func(context.Context, *box, []string, string, io.Reader, io.Writer, io.Writer) int { return 0 },
		"false": func(context.Context, *box, []string, string, io.Reader, io.Writer, io.Writer) int { return 1 },
	}
}

func utilityNames() []string {
	out := make([]string, 0, len(utilities))
	for n := range utilities {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// flags splits leading single-letter options (and --) from operands.
func flags(args []string, allowed string) (set map[byte]bool, rest []string, err error) {
	set = map[byte]bool{}
	for i, a := range args {
		if a == "--" {
			return set, args[i+1:], nil
		}
		if !strings.HasPrefix(a, "-") || a == "-" {
			return set, args[i:], nil
		}
		for _, c := range []byte(a[1:]) {
			if !strings.ContainsRune(allowed, rune(c)) {
				return nil, nil, fmt.Errorf("option -%c is not supported in a simulated sandbox", c)
			}
			set[c] = true
		}
	}
	return set, nil, nil
}

func fail(stderr io.Writer, tool string, err error) int {
	fmt.Fprintf(stderr, "%s: %v\n", tool, err)
	return 1
}

func catU(ctx context.Context, b *box, args []string, cwd string, stdin io.Reader, stdout, stderr io.Writer) int {
	_, ops, err := flags(args, "")
	if err != nil {
		return fail(stderr, "cat", err)
	}
	if len(ops) == 0 {
		if _, err := io.Copy(stdout, stdin); err != nil {
			return fail(stderr, "cat", err)
		}
		return 0
	}
	code := 0
	for _, o := range ops {
		b.mu.Lock()
		data, err := b.fs.read(clean(cwd, o))
		b.mu.Unlock()
		if err != nil {
			code = fail(stderr, "cat", err)
			continue
		}
		_, _ = stdout.Write(data)
	}
	return code
}

func mkdirU(ctx context.Context, b *box, args []string, cwd string, _ io.Reader, _, stderr io.Writer) int {
	set, ops, err := flags(args, "p")
	if err != nil || len(ops) == 0 {
		return fail(stderr, "mkdir", errors.Join(err, errors.New("usage: mkdir [-p] DIRS")))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	for _, o := range ops {
		p := clean(cwd, o)
		if !set['p'] {
			if _, ok := b.fs[p]; ok {
				return fail(stderr, "mkdir", pathErr("mkdir", p, fs.ErrExist))
			}
			if err := b.fs.parentOK(p); err != nil {
				return fail(stderr, "mkdir", err)
			}
		}
		if err := b.fs.mkdirAll(p, 0o755, now); err != nil {
			return fail(stderr, "mkdir", err)
		}
	}
	return 0
}

func rmU(ctx context.Context, b *box, args []string, cwd string, _ io.Reader, _, stderr io.Writer) int {
	set, ops, err := flags(args, "rRf")
	if err != nil {
		return fail(stderr, "rm", err)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, o := range ops {
		p := clean(cwd, o)
		e, ok := b.fs[p]
		switch {
		case !ok && set['f']:
		case !ok:
			return fail(stderr, "rm", pathErr("remove", p, fs.ErrNotExist))
		case e.isDir() && !set['r'] && !set['R']:
			return fail(stderr, "rm", pathErr("remove", p, errors.New("is a directory")))
		default:
			if err := b.fs.remove(p, true); err != nil {
				return fail(stderr, "rm", err)
			}
		}
	}
	return 0
}

func mvU(ctx context.Context, b *box, args []string, cwd string, _ io.Reader, _, stderr io.Writer) int {
	_, ops, err := flags(args, "f")
	if err != nil || len(ops) != 2 {
		return fail(stderr, "mv", errors.Join(err, errors.New("usage: mv [-f] SRC DST")))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.fs.rename(clean(cwd, ops[0]), clean(cwd, ops[1])); err != nil {
		return fail(stderr, "mv", err)
	}
	return 0
}

func chmodU(ctx context.Context, b *box, args []string, cwd string, _ io.Reader, _, stderr io.Writer) int {
	_, ops, err := flags(args, "")
	if err != nil || len(ops) < 2 {
		return fail(stderr, "chmod", errors.Join(err, errors.New("usage: chmod OCTAL-MODE FILES")))
	}
	m, err := strconv.ParseUint(ops[0], 8, 32)
	if err != nil || m > 0o7777 {
		return fail(stderr, "chmod", fmt.Errorf("mode %q: give an octal mode", ops[0]))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, o := range ops[1:] {
		p := clean(cwd, o)
		e, ok := b.fs[p]
		if !ok {
			return fail(stderr, "chmod", pathErr("chmod", p, fs.ErrNotExist))
		}
		e.mode = e.mode&^fs.ModePerm | fs.FileMode(m)&fs.ModePerm
		b.fs[p] = e
	}
	return 0
}

// statU is `stat -c FORMAT FILE...` with %a (octal mode), %u and %g (0:
// one user), %s (size) and %n (name).
func statU(ctx context.Context, b *box, args []string, cwd string, _ io.Reader, stdout, stderr io.Writer) int {
	if len(args) < 3 || args[0] != "-c" {
		return fail(stderr, "stat", errors.New("usage: stat -c FORMAT FILES"))
	}
	format, ops := args[1], args[2:]
	if len(ops) > 0 && ops[0] == "--" {
		ops = ops[1:]
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, o := range ops {
		p := clean(cwd, o)
		e, ok := b.fs[p]
		if !ok {
			return fail(stderr, "stat", pathErr("stat", p, fs.ErrNotExist))
		}
		r := strings.NewReplacer("%a", strconv.FormatUint(uint64(e.mode.Perm()), 8), "%u", "0", "%g", "0",
			"%s", strconv.Itoa(len(e.data.Value())), "%n", o)
		fmt.Fprintln(stdout, r.Replace(format))
	}
	return 0
}

func sleepU(ctx context.Context, _ *box, args []string, _ string, _ io.Reader, _, stderr io.Writer) int {
	if len(args) != 1 {
		return fail(stderr, "sleep", errors.New("usage: sleep SECONDS"))
	}
	s, err := strconv.ParseFloat(args[0], 64)
	if err != nil || s < 0 {
		return fail(stderr, "sleep", fmt.Errorf("%q: give seconds", args[0]))
	}
	t := time.NewTimer(time.Duration(s * float64(time.Second)))
	defer t.Stop()
	select {
	case <-t.C:
		return 0
	case <-ctx.Done():
		return 130
	}
}

func touchU(ctx context.Context, b *box, args []string, cwd string, _ io.Reader, _, stderr io.Writer) int {
	_, ops, err := flags(args, "")
	if err != nil || len(ops) == 0 {
		return fail(stderr, "touch", errors.Join(err, errors.New("usage: touch FILES")))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	for _, o := range ops {
		p := clean(cwd, o)
		if e, ok := b.fs[p]; ok {
			e.mtime = now
			b.fs[p] = e
			continue
		}
		if err := b.fs.write(p, nil, 0o644, now); err != nil {
			return fail(stderr, "touch", err)
		}
	}
	return 0
}
