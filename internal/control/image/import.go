package image

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/match"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// ImportConfig is the config of an image made from a root file system
// tarball.
type ImportConfig struct {
	Env        []string
	WorkingDir string
	// Created is the image's creation time (zero: the Unix epoch, so that
	// the same tarball always makes the same image).
	Created time.Time
}

// Import makes a one-layer image of a root file system tarball (what
// mmdebstrap or `tar -C ROOT -c .` writes) and puts it, tagged, in the OCI
// image layout at dir (made if missing; an image already there under the
// same tag is replaced). It returns the image's digest.
func Import(tarPath, dir, tag string, cfg ImportConfig) (string, error) {
	if tag == "" {
		return "", fmt.Errorf("import %s: give a tag", tarPath)
	}
	if _, err := os.Stat(tarPath); err != nil {
		return "", fmt.Errorf("import: %w", err)
	}
	layer, err := tarball.LayerFromFile(tarPath)
	if err != nil {
		return "", fmt.Errorf("import %s: %w", tarPath, err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return "", fmt.Errorf("import %s: %w", tarPath, err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return "", err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = platform.OS, platform.Architecture
	cf.Config.Env = cfg.Env
	cf.Config.WorkingDir = cfg.WorkingDir
	cf.Created = v1.Time{Time: cfg.Created.UTC()}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return "", err
	}
	if img, err = mutate.CreatedAt(img, v1.Time{Time: cfg.Created.UTC()}); err != nil {
		return "", err
	}
	var lp layout.Path
	if _, err := os.Stat(filepath.Join(dir, "index.json")); err == nil {
		if lp, err = layout.FromPath(dir); err != nil {
			return "", fmt.Errorf("import into %s: %w", dir, err)
		}
	} else if lp, err = layout.Write(dir, empty.Index); err != nil {
		return "", fmt.Errorf("import into %s: %w", dir, err)
	}
	ann := map[string]string{refName: tag}
	if err := lp.ReplaceImage(img, match.Annotation(refName, tag), layout.WithAnnotations(ann)); err != nil {
		return "", fmt.Errorf("import into %s: %w", dir, err)
	}
	d, err := img.ConfigName()
	if err != nil {
		return "", err
	}
	return d.String(), nil
}
