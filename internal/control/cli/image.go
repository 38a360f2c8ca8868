package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"stasis/errdefs"
	"stasis/internal/control/home"
	"stasis/internal/control/image"
	"stasis/internal/providers/local"
	"stasis/internal/providers/microvm"
	"stasis/internal/storage/store"
)

func newImageCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "image",
		Short: "Pull, list and remove the images sandboxes run on",
		Long: `image manages the images local sandboxes take their root from.

An image is named by a reference:
  oci:PATH[:TAG]            an OCI image layout directory (TAG: its
                            org.opencontainers.image.ref.name; needed when
                            the layout holds more than one image)
  docker-archive:PATH       a tarball as "docker save" writes it
  docker://HOST/REPO:TAG    an image in a registry (credentials from the
                            docker config file, ~/.docker/config.json or
                            $DOCKER_CONFIG; plain HTTP only on loopback)
  sha256:HEX                an image already pulled, by digest

Pulling unpacks the image once per digest (its config's digest, the same
whichever form it came from) into $STASIS_HOME/images/sha256-HEX/rootfs,
with its whiteouts applied and its owners, modes, links and extended
attributes kept (owners shifted into the sandboxes' user namespaces);
every sandbox on that image shares that copy, read-only. A pull that is
interrupted leaves nothing a later one would use. "stasis sandbox create
--image REF" pulls what is missing.

Removing refuses an image a sandbox runs on, a snapshot was made on, or a
committed checkpoint's record names; gc removes every other.

Exit status: 0 done; 2 a bad reference or a refusal; 3 no such image; 1
anything else.`,
	}
	cmd.AddCommand(newImageLsCmd(), newImagePullCmd(), newImageRmCmd(), newImageGCCmd(), newImageImportCmd())
	return cmd
}

func openImages() (*local.Provider, *image.Store, error) {
	p, err := openLocal()
	if err != nil {
		return nil, nil, err
	}
	return p, p.Images(), nil
}

// openImagesInUse opens the image store with what uses each image
// (imageUsers).
func openImagesInUse(ctx context.Context) (*image.Store, image.InUse, error) {
	p, s, err := openImages()
	if err != nil {
		return nil, nil, err
	}
	inUse, err := imageUsers(ctx, p)
	if err != nil {
		return nil, nil, err
	}
	return s, inUse, nil
}

func shortDigest(d string) string {
	if len(d) > len("sha256:")+12 {
		return d[:len("sha256:")+12]
	}
	return d
}

func newImageLsCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List the pulled images",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, s, err := openImages()
			if err != nil {
				return err
			}
			l, err := s.List()
			if err != nil {
				return err
			}
			if asJSON {
				if l == nil {
					l = []image.Image{}
				}
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(l)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "DIGEST\tREFERENCE\tSIZE\tFILES\tUNPACKED")
			for _, im := range l {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\n", shortDigest(im.Digest), im.Ref(), humanize.IBytes(uint64(im.Bytes)), im.Files, im.Unpacked.Local().Format(time.DateTime))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// pullWithProgress resolves ref in s, drawing the unpack's progress on
// stderr.
func pullWithProgress(ctx context.Context, cmd *cobra.Command, s *image.Store, ref string) (image.Image, error) {
	if f, ok := cmd.ErrOrStderr().(*os.File); !ok || !term.IsTerminal(int(f.Fd())) {
		// Not a terminal: one line, not a redrawn bar.
		fmt.Fprintf(cmd.ErrOrStderr(), "pulling %s (unpacked once per digest)\n", ref)
		return s.Pull(ctx, ref, nil)
	}
	bar := progressbar.NewOptions64(-1, progressbar.OptionSetWriter(cmd.ErrOrStderr()), progressbar.OptionSetDescription("unpacking "+ref),
		progressbar.OptionShowBytes(true), progressbar.OptionClearOnFinish(), progressbar.OptionSpinnerType(14), progressbar.OptionThrottle(200*time.Millisecond))
	im, err := s.Pull(ctx, ref, func(bytes int64, files int) { _ = bar.Set64(bytes) })
	_ = bar.Finish()
	return im, err
}

func imageErr(err error) error {
	if err == nil {
		return nil
	}
	return &exitError{Code: errdefs.ExitCode(err), Err: err}
}

func newImagePullCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "pull REF",
		Short: "Pull and unpack an image; prints its digest",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if _, err := image.ParseRef(args[0]); err != nil {
				return &exitError{Code: 2, Err: err}
			}
			_, s, err := openImages()
			if err != nil {
				return err
			}
			start := time.Now()
			im, err := pullWithProgress(cmd.Context(), cmd, s, args[0])
			if err != nil {
				return imageErr(err)
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "%s: %s in %d files, %d directories, %d links (%s)\n", args[0], humanize.IBytes(uint64(im.Bytes)), im.Files, im.Dirs, im.Links, time.Since(start).Round(time.Millisecond))
			fmt.Fprintln(cmd.OutOrStdout(), im.Digest)
			return nil
		},
	}
}

// imageUsers says who uses an image: local and microVM sandboxes and
// snapshots, and the records of committed (and pending) checkpoints.
func imageUsers(ctx context.Context, p *local.Provider) (image.InUse, error) {
	users := map[string][]string{}
	sbs, snaps, err := p.ImageUsers(ctx)
	if err != nil {
		return nil, err
	}
	add := func(what string, byImage map[string][]string) {
		for d, ids := range byImage {
			for _, id := range ids {
				users[d] = append(users[d], what+" "+id)
			}
		}
	}
	add("sandbox", sbs)
	add("snapshot", snaps)
	h, err := home.Dir()
	if err != nil {
		return nil, err
	}
	vms, vmSnaps, err := microvm.ImageUsers(h)
	if err != nil {
		return nil, err
	}
	add("microVM", vms)
	add("microVM snapshot", vmSnaps)
	sp, err := store.DefaultPath()
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(sp); err == nil {
		st, err := store.Open(ctx)
		if err != nil {
			return nil, err
		}
		defer st.Close()
		cks, err := st.List(ctx, store.ListOptions{})
		if err != nil {
			return nil, err
		}
		for _, ck := range cks {
			if ck.State == store.StateFailed {
				continue
			}
			_, recs, err := st.Get(ctx, ck.ID)
			if err != nil {
				return nil, err
			}
			for _, r := range recs {
				if r.Image != "" {
					users[r.Image] = append(users[r.Image], fmt.Sprintf("checkpoint %s (episode %s)", ck.ID, r.Episode))
				}
			}
		}
	}
	return func(d string) (string, error) {
		u := users[d]
		if len(u) == 0 {
			return "", nil
		}
		sort.Strings(u)
		if len(u) > 3 {
			return fmt.Sprintf("%s and %d more", strings.Join(u[:3], ", "), len(u)-3), nil
		}
		return strings.Join(u, ", "), nil
	}, nil
}

func newImageRmCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "rm DIGEST|REF...",
		Short: "Remove pulled images that nothing uses",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, inUse, err := openImagesInUse(cmd.Context())
			if err != nil {
				return err
			}
			var failed error
			for _, a := range args {
				d, err := digestOf(s, a)
				if err == nil {
					err = s.Remove(d, inUse)
				}
				if err != nil {
					fmt.Fprintln(cmd.ErrOrStderr(), "stasis:", err)
					if failed == nil {
						failed = imageErr(err)
					}
					continue
				}
				fmt.Fprintln(cmd.OutOrStdout(), d)
			}
			if failed != nil {
				var ee *exitError
				if errors.As(failed, &ee) {
					return &exitError{Code: ee.Code}
				}
				return &exitError{Code: 1}
			}
			return nil
		},
	}
}

// digestOf finds the pulled image a digest, a short digest or a
// reference it was pulled as names.
func digestOf(s *image.Store, a string) (string, error) {
	l, err := s.List()
	if err != nil {
		return "", err
	}
	var hits []string
	for _, im := range l {
		if im.Digest == a || strings.HasPrefix(a, "sha256:") && len(a) >= len("sha256:")+6 && strings.HasPrefix(im.Digest, a) {
			hits = append(hits, im.Digest)
			continue
		}
		for _, r := range im.Refs {
			if r == a {
				hits = append(hits, im.Digest)
				break
			}
		}
	}
	switch len(hits) {
	case 0:
		return "", fmt.Errorf("image %s: %w (`stasis image ls` lists them)", a, image.ErrNotFound)
	case 1:
		return hits[0], nil
	}
	return "", &exitError{Code: 2, Err: fmt.Errorf("image %s names %d images: %s; give more of the digest", a, len(hits), strings.Join(hits, ", "))}
}

func newImageGCCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "gc",
		Short: "Remove every pulled image nothing uses, and what interrupted pulls left",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, inUse, err := openImagesInUse(cmd.Context())
			if err != nil {
				return err
			}
			removed, err := s.GC(inUse)
			for _, d := range removed {
				fmt.Fprintln(cmd.OutOrStdout(), d)
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "removed %d images\n", len(removed))
			return err
		},
	}
}

func newImageImportCmd() *cobra.Command {
	var (
		layoutDir, tag, workdir string
		env                     []string
	)
	cmd := &cobra.Command{
		Use:   "import ROOTFS.tar --layout DIR --tag TAG [--env K=V]...",
		Short: "Make an OCI image layout of a root file system tarball; prints its digest",
		Long: `import makes a one-layer image of a root file system tarball (what
mmdebstrap, or "tar -C ROOT -c .", writes) and puts it in the OCI image
layout DIR under TAG (an image already there under TAG is replaced), to be
used as oci:DIR:TAG. The image's creation time is the Unix epoch, so one
tarball always makes one digest.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if layoutDir == "" || tag == "" {
				return &exitError{Code: 2, Err: errors.New("give --layout DIR and --tag TAG")}
			}
			for _, kv := range env {
				if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
					return &exitError{Code: 2, Err: fmt.Errorf("--env %q: use KEY=VALUE", kv)}
				}
			}
			d, err := image.Import(args[0], layoutDir, tag, image.ImportConfig{Env: env, WorkingDir: workdir})
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), d)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&layoutDir, "layout", "", "the OCI image layout directory to write (made if missing)")
	f.StringVar(&tag, "tag", "", "the image's tag in the layout")
	f.StringArrayVar(&env, "env", nil, "an environment variable of the image's config, KEY=VALUE (repeatable)")
	f.StringVar(&workdir, "workdir", "", "the image config's working directory")
	return cmd
}
