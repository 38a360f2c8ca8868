package cli

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"stasis/errdefs"
	"stasis/internal/control/home"
	"stasis/internal/control/image"
	"stasis/internal/control/system"
	"stasis/internal/copyout"
	"stasis/internal/fileop"
	"stasis/internal/providers/local"
	"stasis/internal/providers/sim"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// openProvider opens the named sandbox provider on $STASIS_HOME, or on
// the provider's home in a `stasis serve` state directory state when that
// is set, its snapshots in the shared blob store blobs if that is set.
func openProvider(name, state, blobs string) (sandbox.Provider, error) {
	if _, err := sandbox.Lookup(name); err != nil {
		return nil, &exitError{Code: errdefs.ExitRefused, Err: fmt.Errorf("--provider: %w", err)}
	}
	if blobs != "" && !sandbox.KeepsBlobs(name) {
		return nil, &exitError{Code: errdefs.ExitRefused, Err: fmt.Errorf("--blobs: the %s provider keeps no snapshots in a shared store (the local and microvm providers do)", name)}
	}
	h, err := home.Dir()
	if err != nil {
		return nil, err
	}
	if state != "" {
		st, err := os.Stat(state)
		if err != nil {
			return nil, &exitError{Code: errdefs.ExitRefused, Err: fmt.Errorf("--state: %w", err)}
		}
		if !st.IsDir() {
			return nil, &exitError{Code: errdefs.ExitRefused, Err: fmt.Errorf("--state %s: not a directory (a stasis serve --state directory)", state)}
		}
		h = system.ProviderHome(state, name)
	}
	return sandbox.Open(context.Background(), name, sandbox.Config{Home: h, Blobs: blobs})
}

func openLocal() (*local.Provider, error) {
	h, err := home.Dir()
	if err != nil {
		return nil, err
	}
	return local.New(local.Options{Home: h})
}

// sandboxErr turns a provider error into the CLI's exit code.
func sandboxErr(err error) error {
	if err == nil {
		return nil
	}
	var ee *exitError
	if errors.As(err, &ee) {
		return err
	}
	return &exitError{Code: errdefs.ExitCode(err), Err: err}
}

func parseLabels(kvs []string, flag string) (map[string]string, error) {
	m := map[string]string{}
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, &exitError{Code: 2, Err: fmt.Errorf("%s %q: use key=value", flag, kv)}
		}
		m[k] = v
	}
	return m, nil
}

func newSandboxCmd() *cobra.Command {
	var provider string
	cmd := &cobra.Command{
		Use:   "sandbox",
		Short: "Create, run in, snapshot, fork and delete sandboxes",
		Long: `sandbox manages sandboxes directly, for people and scripts.

The local provider (the default) isolates each sandbox with bubblewrap: its
own PID, IPC, UTS, mount and network namespaces (no network but loopback),
the host root read-only, and three writable places kept under the state
directory ($STASIS_HOME, default ~/.local/share/stasis; or, with --state,
a stasis serve's, whose sandboxes these commands then see): /work (the work tree
and the default working directory), $HOME and /tmp. A keeper process on the
host holds each sandbox and kills it at its absolute expiry. Snapshots are
file-only and content-addressed: unchanged files cost nothing.

The microvm provider (--provider microvm) runs each sandbox as a QEMU microVM
with its root file system in guest RAM; a snapshot saves the whole machine,
processes included, and a fork continues them. "stasis sandbox doctor" says
what it needs and whether KVM or TCG is used.

Exit status: 0 done; 2 bad request; 3 no such (or expired) sandbox or
snapshot; 1 anything else. "exec" exits with the command's own status.`,
	}
	cmd.PersistentFlags().StringVar(&provider, "provider", local.Name, "sandbox provider: "+strings.Join(sandbox.Names(), ", ")+" (opensandbox is configured by OPENSANDBOX_URL and OPENSANDBOX_API_KEY, e2b by E2B_API_KEY, E2B_DOMAIN, E2B_API_URL, E2B_SANDBOX_URL, E2B_FILE_ONLY_SNAPSHOTS; "+sim.Help+", whose sandboxes end with the command)")
	var blobs, state string
	cmd.PersistentFlags().StringVar(&state, "state", "", "work on the sandboxes of the stasis serve whose --state directory this is (DIR/PROVIDER), not on $STASIS_HOME's")
	cmd.PersistentFlags().StringVar(&blobs, "blobs", "", "local and microvm providers: the shared S3 store of the snapshots, s3://BUCKET/PREFIX, as the node's stasis serve --blobs (endpoint and credentials from the AWS environment variables)")
	open := func() (sandbox.Provider, error) { return openProvider(provider, state, blobs) }
	cmd.AddCommand(
		newSandboxCreateCmd(open), newSandboxExecCmd(open), newSandboxCpCmd(open), newSandboxLsCmd(open),
		newSandboxSnapshotCmd(open), newSandboxForkCmd(open), newSandboxRmCmd(open), newSandboxGCCmd(open),
		newSandboxExtendCmd(open), newSandboxKeeperCmd(), newSandboxDoctorCmd(),
	)
	return cmd
}

// opener opens the provider a sandbox subcommand works on.
type opener func() (sandbox.Provider, error)

// with opens the provider, runs f with it and closes it.
func (open opener) with(f func(sandbox.Provider) error) error {
	p, err := open()
	if err != nil {
		return err
	}
	defer p.Close()
	return f(p)
}

func newSandboxCreateCmd(open opener) *cobra.Command {
	var (
		ttl         time.Duration
		from, img   string
		labels, env []string
	)
	cmd := &cobra.Command{
		Use:   "create [--ttl D] [--from DIR] [--image REF] [--label k=v]...",
		Short: "Create a sandbox; prints its id on the last line",
		Long: `create makes a sandbox and prints its id on the last line.

With --image the sandbox's root is the image's, read-only, and nothing of
the host's is in it (local and microvm providers; "stasis image --help"
lists the reference forms; a missing image is pulled first). For e2b and
opensandbox, REF is the service's own template or image name, passed on.
Without it a local sandbox sees an allow-list of the host's userland
(/usr, /bin, /lib*, /etc without its secrets) read-only.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			l, err := parseLabels(labels, "--label")
			if err != nil {
				return err
			}
			e, err := parseLabels(env, "--env")
			if err != nil {
				return err
			}
			if ttl <= 0 {
				return &exitError{Code: 2, Err: errors.New("--ttl must be above zero")}
			}
			return open.with(func(p sandbox.Provider) error {
				if lp, ok := p.(*local.Provider); ok && img != "" {
					// Pull first, with progress; the sandbox then names the
					// digest.
					if _, err := image.ParseRef(img); err != nil {
						return &exitError{Code: 2, Err: err}
					}
					im, err := pullWithProgress(cmd.Context(), cmd, lp.Images(), img)
					if err != nil {
						return imageErr(err)
					}
					img = im.Digest
				}
				info, err := p.Create(cmd.Context(), sandbox.Spec{Root: from, Image: img, Labels: l, Env: e, Expiry: time.Now().Add(ttl)})
				if err != nil {
					return sandboxErr(err)
				}
				fmt.Fprintf(cmd.ErrOrStderr(), "created %s (%s), expires %s\n", info.ID, info.Provider, info.Expiry.Local().Format(time.RFC3339))
				fmt.Fprintln(cmd.OutOrStdout(), info.ID)
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.DurationVar(&ttl, "ttl", time.Hour, "lease: the sandbox is killed this long from now (an absolute expiry)")
	f.StringVar(&from, "from", "", "host directory copied into /work")
	f.StringVar(&img, "image", "", "the image the sandbox's root is made of (oci:PATH[:TAG], docker-archive:PATH, docker://HOST/REPO:TAG, sha256:HEX; a template name on e2b and opensandbox)")
	f.StringArrayVar(&labels, "label", nil, "label key=value (repeatable)")
	f.StringArrayVar(&env, "env", nil, "environment key=value for every exec (repeatable)")
	return cmd
}

func newSandboxExecCmd(open opener) *cobra.Command {
	var (
		cwd, logPath string
		env          []string
		timeout      time.Duration
		background   bool
	)
	cmd := &cobra.Command{
		Use:   "exec ID [--cwd D] [--env k=v] [--timeout D] [--background] -- CMD [ARGS...]",
		Short: "Run a command in a sandbox, passing stdin, stdout, stderr and the exit code through",
		Args:  cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 1 {
				return &exitError{Code: 2, Err: errors.New("put the command after --: stasis sandbox exec ID -- CMD")}
			}
			e, err := parseLabels(env, "--env")
			if err != nil {
				return err
			}
			return open.with(func(p sandbox.Provider) error {
				req := sandbox.ExecRequest{Argv: args[1:], Env: e, Cwd: cwd, Timeout: timeout, Background: background, LogPath: logPath,
					Stdin: os.Stdin, Stdout: cmd.OutOrStdout(), Stderr: cmd.ErrOrStderr()}
				if fi, err := os.Stdin.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
					req.Stdin = nil // a terminal: the command gets no input rather than a hang
				}
				res, err := p.Exec(cmd.Context(), args[0], req)
				if err != nil {
					return sandboxErr(err)
				}
				if background {
					fmt.Fprintln(cmd.OutOrStdout(), res.PID)
					return nil
				}
				switch {
				case res.ExitCode < 0:
					return &exitError{Code: 128 - res.ExitCode}
				case res.ExitCode > 0:
					return &exitError{Code: res.ExitCode}
				}
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&cwd, "cwd", "", "working directory inside (default /work)")
	f.StringArrayVar(&env, "env", nil, "environment key=value (repeatable)")
	f.DurationVar(&timeout, "timeout", 0, "kill the command after this long (0: none)")
	f.BoolVar(&background, "background", false, "start it in its own session and print its pid; it runs until it ends or the sandbox goes")
	f.StringVar(&logPath, "log", "", "with --background: file inside the sandbox for its output")
	return cmd
}

// splitRemote parses ID:/path.
func splitRemote(s string) (id, path string, ok bool) {
	i := strings.Index(s, ":")
	if i <= 0 || strings.Contains(s[:i], "/") {
		return "", "", false
	}
	return s[:i], s[i+1:], true
}

func newSandboxCpCmd(open opener) *cobra.Command {
	return &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy files or directories between the host and a sandbox (ID:/path names the sandbox side)",
		Long: `cp copies a file or a directory tree between the host and a sandbox; exactly
one side is ID:/path. A directory is copied into DST (which is created); a
file is copied to DST.

  stasis sandbox cp ./repo sb-0123456789abcdef:/work/repo
  stasis sandbox cp sb-0123456789abcdef:/work/out ./out`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			return open.with(func(p sandbox.Provider) error {
				ctx := cmd.Context()
				sid, spath, sremote := splitRemote(args[0])
				did, dpath, dremote := splitRemote(args[1])
				switch {
				case sremote == dremote:
					return &exitError{Code: 2, Err: errors.New("exactly one of SRC and DST must be ID:/path")}
				case dremote:
					return sandboxErr(copyIn(ctx, p, args[0], did, dpath))
				default:
					return sandboxErr(copyOut(ctx, p, sid, spath, args[1], cmd.ErrOrStderr()))
				}
			})
		},
	}
}

// copyIn tars a host file or directory and uploads it. Copy-in keeps what
// the host's tar (or tar.FileInfoHeader, for one file) records: permission
// bits including setuid, setgid and sticky, symlinks and times. Every
// provider extracts it inside the sandbox with tar --no-same-owner (the
// microVM's guest agent never chowns either), so the files belong to the
// user that extracts them there, and a setuid bit only ever grants a uid of the
// sandbox's own.
func copyIn(ctx context.Context, p sandbox.Files, src, id, dst string) error {
	fi, err := os.Stat(src)
	if err != nil {
		return &exitError{Code: 2, Err: err}
	}
	pr, pw := io.Pipe()
	dir, name := dst, "."
	if !fi.IsDir() {
		dir, name = filepath.Dir(dst), filepath.Base(dst)
	}
	go func() {
		var err error
		if fi.IsDir() {
			err = tarDir(pw, src)
		} else {
			err = tarFile(pw, src, name, fi)
		}
		pw.CloseWithError(err)
	}()
	return p.Upload(ctx, id, dir, pr)
}

func tarFile(w io.Writer, src, name string, fi fs.FileInfo) error {
	tw := tar.NewWriter(w)
	h, err := tar.FileInfoHeader(fi, "")
	if err != nil {
		return err
	}
	h.Name = name
	if err := tw.WriteHeader(h); err != nil {
		return err
	}
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := io.Copy(tw, f); err != nil {
		return err
	}
	return tw.Close()
}

func tarDir(w io.Writer, src string) error { return fileop.Pack(src, w) }

// copyOut copies a sandbox path to the host with internal/copyout, which
// every provider's copy-out goes through: what the sandbox made arrives
// without setuid, setgid or sticky-file bits, owned by the user running
// stasis, with no device, fifo or link leading out of dst; each entry not
// copied is named in a warning on stderr.
func copyOut(ctx context.Context, p sandbox.Files, id, src, dst string, stderr io.Writer) error {
	res, err := copyout.Copy(ctx, p, id, src, dst, copyout.Options{Warn: func(s copyout.Skipped) {
		fmt.Fprintf(stderr, "warning: not copied: %s\n", s)
	}})
	if err == nil && len(res.Skipped) > 0 {
		fmt.Fprintf(stderr, "copied %d files into %s; %d entries not copied (see the warnings)\n", res.Files+res.Links, dst, len(res.Skipped))
	}
	return err
}

func newSandboxLsCmd(open opener) *cobra.Command {
	var (
		labels []string
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "ls [--label k=v]... [--json]",
		Short: "List sandboxes as a table (or JSON)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			l, err := parseLabels(labels, "--label")
			if err != nil {
				return err
			}
			return open.with(func(p sandbox.Provider) error {
				list, err := p.List(cmd.Context(), l)
				if err != nil {
					return sandboxErr(err)
				}
				out := cmd.OutOrStdout()
				if asJSON {
					if list == nil {
						list = []sandbox.Info{}
					}
					printJSON(out, list)
					return nil
				}
				tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "ID\tSTATE\tCREATED\tEXPIRES IN\tSOURCE\tLABELS")
				for _, s := range list {
					left := time.Until(s.Expiry).Round(time.Second).String()
					if s.State != sandbox.StateRunning {
						left = "-"
					}
					var ls []string
					for k, v := range s.Labels {
						ls = append(ls, k+"="+v)
					}
					sort.Strings(ls)
					src := s.Source
					if src == "" {
						src = "-"
					}
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", s.ID, s.State, s.Created.Local().Format("2006-01-02 15:04:05"), left, src, strings.Join(ls, ","))
				}
				tw.Flush()
				if len(list) == 0 {
					fmt.Fprintln(cmd.ErrOrStderr(), "no sandboxes")
				}
				return nil
			})
		},
	}
	cmd.Flags().StringArrayVar(&labels, "label", nil, "only sandboxes with this label key=value (repeatable)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newSandboxSnapshotCmd(open opener) *cobra.Command {
	var name string
	cmd := &cobra.Command{
		Use:   "snapshot ID [--name N]",
		Short: "Snapshot a sandbox; prints the snapshot id on the last line",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return open.with(func(p sandbox.Provider) error {
				t0 := time.Now()
				snap, err := p.Snapshot(cmd.Context(), args[0], name)
				if err != nil {
					return sandboxErr(err)
				}
				fmt.Fprintf(cmd.ErrOrStderr(), "snapshot of %s in %s: %d bytes, %d new\n", args[0], time.Since(t0).Round(time.Millisecond), snap.Bytes, snap.NewBytes)
				fmt.Fprintln(cmd.OutOrStdout(), snap.ID)
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&name, "name", "", "a name for the snapshot")
	return cmd
}

func newSandboxForkCmd(open opener) *cobra.Command {
	var (
		count  int
		ttl    time.Duration
		labels []string
	)
	cmd := &cobra.Command{
		Use:   "fork SNAPSHOT [--count N] [--ttl D] [--label k=v]...",
		Short: "Start sandboxes from a snapshot; prints one new id per line (all or nothing)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := parseLabels(labels, "--label")
			if err != nil {
				return err
			}
			return open.with(func(p sandbox.Provider) error {
				infos, err := p.Fork(cmd.Context(), args[0], count, sandbox.ForkSpec{Labels: l, Expiry: time.Now().Add(ttl)})
				if err != nil {
					return sandboxErr(err)
				}
				for _, in := range infos {
					fmt.Fprintln(cmd.OutOrStdout(), in.ID)
				}
				return nil
			})
		},
	}
	cmd.Flags().IntVar(&count, "count", 1, "how many sandboxes")
	cmd.Flags().DurationVar(&ttl, "ttl", time.Hour, "lease of each new sandbox")
	cmd.Flags().StringArrayVar(&labels, "label", nil, "label key=value (repeatable)")
	return cmd
}

func newSandboxRmCmd(open opener) *cobra.Command {
	var snapshots bool
	cmd := &cobra.Command{
		Use:   "rm ID... [--snapshot]",
		Short: "Delete sandboxes (or, with --snapshot, snapshots); deleting one already gone succeeds",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return open.with(func(p sandbox.Provider) error {
				for _, id := range args {
					var err error
					if snapshots {
						err = p.DeleteSnapshot(cmd.Context(), id)
					} else {
						err = p.Delete(cmd.Context(), id)
					}
					if err != nil {
						return sandboxErr(err)
					}
					fmt.Fprintln(cmd.OutOrStdout(), "deleted", id)
				}
				return nil
			})
		},
	}
	cmd.Flags().BoolVar(&snapshots, "snapshot", false, "the ids are snapshots")
	return cmd
}

// homeForgetter is a provider on a shared blob store that can drop the
// bases another state directory published there.
type homeForgetter interface {
	ForgetHome(ctx context.Context, home string) (int, error)
}

func newSandboxGCCmd(open opener) *cobra.Command {
	var forget string
	cmd := &cobra.Command{
		Use:   "gc [--blobs s3://BUCKET/PREFIX [--forget-home ID]]",
		Short: "Remove sandboxes whose keeper died (ending a QEMU left behind), and blobs nothing references",
		Long: `gc removes the sandboxes whose keeper died and then the blobs that no
snapshot and no sandbox's incremental base references. The microvm
provider's gc also lets run again a machine an interrupted snapshot left
stopped, and removes the QEMU monitor sockets (/tmp/stasis-qmp-*.sock) of
machines that ended with no one to clean up after them.

With --blobs (the store the nodes share) the collection covers every node:
it keeps the blobs of every snapshot record in the store and of every
sandbox base any node published there, and every blob stored less than
two hours ago (snapshots and forks in progress anywhere). One node
collects at a time; gc waits for another node's collection to finish.

A node whose machine is gone for good keeps its sandboxes' bases, and so
their blobs, until its state directory is opened again or an operator
runs gc --forget-home ID (the store's records/homes/ name each state
directory's ID, host and path; a directory's own ID is in its home-id
file).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return open.with(func(p sandbox.Provider) error {
				if forget != "" {
					f, ok := p.(homeForgetter)
					if !ok {
						return &exitError{Code: errdefs.ExitRefused, Err: fmt.Errorf("--forget-home: the %s provider publishes no bases", p.Name())}
					}
					n, err := f.ForgetHome(cmd.Context(), forget)
					if err != nil {
						return sandboxErr(err)
					}
					fmt.Fprintf(cmd.OutOrStdout(), "forgot home %s: %d published bases removed\n", forget, n)
				}
				reaped, err := p.GC(cmd.Context())
				if err != nil {
					return err
				}
				for _, id := range reaped {
					fmt.Fprintln(cmd.OutOrStdout(), "reaped", id)
				}
				n, bytes, err := p.CollectBlobs(cmd.Context())
				if err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%d sandboxes reaped, %d blobs (%d bytes) freed\n", len(reaped), n, bytes)
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&forget, "forget-home", "", "with --blobs: first remove the bases state directory ID published (its machine is gone for good)")
	return cmd
}

func newSandboxExtendCmd(open opener) *cobra.Command {
	var ttl time.Duration
	cmd := &cobra.Command{
		Use:   "expire ID --ttl D",
		Short: "Set a sandbox's absolute expiry to D from now (longer or shorter)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return open.with(func(p sandbox.Provider) error {
				t := time.Now().Add(ttl)
				if err := p.SetExpiry(cmd.Context(), args[0], t); err != nil {
					return sandboxErr(err)
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%s expires %s\n", args[0], t.Local().Format(time.RFC3339))
				return nil
			})
		},
	}
	cmd.Flags().DurationVar(&ttl, "ttl", time.Hour, "new lease from now")
	return cmd
}

func newSandboxKeeperCmd() *cobra.Command {
	cmd := newKeeperCmd("Hold one local sandbox (started by create and fork)", "keeper", local.RunKeeper)
	cmd.Hidden = true
	return cmd
}

// newKeeperCmd is a provider's keeper command: it holds one sandbox, whose
// state directory --dir names, logging as component to stderr.
func newKeeperCmd(short, component string, run func(dir string, log *slog.Logger) int) *cobra.Command {
	var dir string
	cmd := &cobra.Command{
		Use:   "keeper --dir DIR",
		Short: short,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("component", component)
			if code := run(dir, log); code != 0 {
				return &exitError{Code: code}
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "the sandbox's state directory")
	return cmd
}

func init() { snapshotFreer = freeSnapshots }

// freeSnapshots deletes, through their providers, the snapshots that no
// checkpoint references any more (after `stasis ckpt rm`): the providers
// of the stasis serve whose state directory state is, or $STASIS_HOME's
// for ""; those of the providers that keep snapshots in a shared store
// (local, microvm) are in blobs when that is set.
func freeSnapshots(ctx context.Context, refs []store.SnapshotRef, state, blobs string) error {
	var errs []error
	for _, r := range refs {
		shared := ""
		if sandbox.KeepsBlobs(r.Provider) {
			shared = blobs
		}
		p, err := openProvider(r.Provider, state, shared)
		if err != nil {
			errs = append(errs, fmt.Errorf("snapshot %s: %w", r.SnapshotID, err))
			continue
		}
		if err := p.DeleteSnapshot(ctx, r.SnapshotID); err != nil {
			errs = append(errs, err)
		}
		p.Close() // its store's read cache is locked while it is open
	}
	return errors.Join(errs...)
}
