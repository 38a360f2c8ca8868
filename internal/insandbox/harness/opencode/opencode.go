// Package opencode runs OpenCode (the npm package opencode-ai) as a harness
// whose every model call goes through the stasis relay.
//
// OpenCode gets one custom OpenAI-compatible provider, [Provider], whose base
// URL is the relay, and no other; sharing, autoupdate, the models.dev fetch
// and LSP downloads are off, and tool permissions allow everything a
// non-interactive run needs. Its configuration, data, cache and state all
// live under one directory (Env), so an episode's OpenCode session is in that
// directory and nothing of the host user's OpenCode setup leaks in.
//
// OpenCode carries the provider package (@ai-sdk/openai-compatible) in its
// binary; the one thing it would fetch from the npm registry at run time is
// @opencode-ai/plugin for its config directory. Prepare links the copy that
// `make deps-opencode` installs beside OpenCode, so a run needs no network
// beyond the relay.
//
// This is the small part: configure and start `opencode run`. Resuming a
// saved session belongs to the harness adapter.
package opencode

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Version is the opencode-ai version `make deps-opencode` installs.
const Version = "1.18.33"

// Provider is the id of the provider the configuration defines; OpenCode
// names models as Provider/MODEL.
const Provider = "stasis"

// EnvBinary names the variable that overrides where Binary looks.
const EnvBinary = "STASIS_OPENCODE"

// binRel is where `make deps-opencode` puts OpenCode, under the module root.
const binRel = ".tools/npm/node_modules/.bin/opencode"

// pluginPkg is the package OpenCode installs into each config directory.
const pluginPkg = "@opencode-ai/plugin"

// Binary returns the OpenCode executable: $STASIS_OPENCODE when set,
// otherwise .tools/npm/node_modules/.bin/opencode under the module root (the
// nearest directory above the working directory holding go.mod).
func Binary() (string, error) {
	if p := os.Getenv(EnvBinary); p != "" {
		if err := executable(p); err != nil {
			return "", fmt.Errorf("opencode: $%s=%s: %w", EnvBinary, p, err)
		}
		return p, nil
	}
	root, err := moduleRoot()
	if err != nil {
		return "", fmt.Errorf("opencode: %w; set $%s to the opencode binary", err, EnvBinary)
	}
	p := filepath.Join(root, binRel)
	if err := executable(p); err != nil {
		return "", fmt.Errorf("opencode: %s: %w; `make deps-opencode` installs opencode-ai %s there (make test does it first), or set $%s", p, err, Version, EnvBinary)
	}
	return p, nil
}

func executable(p string) error {
	st, err := os.Stat(p)
	if err != nil {
		return err
	}
	if st.IsDir() || st.Mode().Perm()&0o111 == 0 {
		return errors.New("not an executable file")
	}
	return nil
}

func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		up := filepath.Dir(dir)
		if up == dir {
			return "", errors.New("no go.mod above the working directory")
		}
		dir = up
	}
}

// Prefix is the npm prefix OpenCode binary bin was installed into: bin
// (PREFIX/node_modules/.bin/opencode) is a link to
// PREFIX/node_modules/opencode-ai/bin/opencode(.exe).
func Prefix(bin string) (string, error) {
	real, err := filepath.EvalSymlinks(bin)
	if err != nil {
		return "", fmt.Errorf("opencode: %w", err)
	}
	return filepath.Dir(filepath.Dir(filepath.Dir(filepath.Dir(real)))), nil
}

// config is the part of opencode.json this package writes.
type config struct {
	Model            string              `json:"model"`
	SmallModel       string              `json:"small_model"`
	EnabledProviders []string            `json:"enabled_providers"`
	Share            string              `json:"share"`
	Autoupdate       bool                `json:"autoupdate"`
	Permission       map[string]string   `json:"permission"`
	Provider         map[string]provider `json:"provider"`
}

type provider struct {
	NPM     string           `json:"npm"`
	Name    string           `json:"name"`
	Options providerOptions  `json:"options"`
	Models  map[string]model `json:"models"`
}

type providerOptions struct {
	BaseURL string `json:"baseURL"`
	APIKey  string `json:"apiKey"`
}

type model struct {
	Name string `json:"name"`
}

// Config returns an opencode.json with one provider, [Provider], an
// OpenAI-compatible endpoint at baseURL (the relay, with its /v1) serving
// model, used for every agent; no other provider is enabled, nothing is
// shared, autoupdate is off, and every tool is allowed without asking (the
// question tool, which needs a person, is denied).
func Config(baseURL, modelName string) ([]byte, error) {
	u, err := url.Parse(baseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("opencode: base URL %q: want http://HOST:PORT/v1 (OpenCode reaches the relay over TCP)", baseURL)
	}
	if modelName == "" || strings.ContainsAny(modelName, "/ ") {
		return nil, fmt.Errorf("opencode: model name %q: want a non-empty name without '/' or spaces", modelName)
	}
	c := config{
		Model:            Provider + "/" + modelName,
		SmallModel:       Provider + "/" + modelName,
		EnabledProviders: []string{Provider},
		Share:            "disabled",
		Autoupdate:       false,
		Permission: map[string]string{
			"*": "allow", "external_directory": "allow", "doom_loop": "allow", "question": "deny",
		},
		Provider: map[string]provider{Provider: {
			NPM:  "@ai-sdk/openai-compatible",
			Name: "stasis relay",
			// The relay authenticates upstream itself; the key only keeps the
			// SDK from complaining.
			Options: providerOptions{BaseURL: strings.TrimSuffix(baseURL, "/"), APIKey: "stasis-relay"},
			Models:  map[string]model{modelName: {Name: modelName}},
		}},
	}
	b, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// Paths under an OpenCode directory.
func configFile(dir string) string { return filepath.Join(dir, "opencode.json") }
func configDir(dir string) string  { return filepath.Join(dir, "config", "opencode") }

// DataDir is where OpenCode keeps its sessions (opencode.db) and logs.
func DataDir(dir string) string { return filepath.Join(dir, "data", "opencode") }

// Prepare makes dir ready for Env: it writes dir/opencode.json (Config) and
// gives OpenCode's config directory the @opencode-ai/plugin that `make
// deps-opencode` installs beside bin, so OpenCode does not try to install
// it from the registry. Without that copy Prepare still succeeds; OpenCode
// then tries the install in the background, and a failure does not stop a
// run.
func Prepare(bin, dir, baseURL, modelName string) error {
	b, err := Config(baseURL, modelName)
	if err != nil {
		return err
	}
	cd := configDir(dir)
	if err := os.MkdirAll(cd, 0o755); err != nil {
		return fmt.Errorf("opencode: %w", err)
	}
	if err := os.WriteFile(configFile(dir), b, 0o644); err != nil {
		return fmt.Errorf("opencode: %w", err)
	}
	return seedPlugin(bin, cd)
}

// seedPlugin links node_modules of bin's npm prefix into the config
// directory and declares @opencode-ai/plugin there, which is what OpenCode
// checks before it installs: a node_modules directory and a lock naming
// every dependency. It does nothing when the plugin is not installed there.
func seedPlugin(bin, cd string) error {
	real, err := filepath.EvalSymlinks(bin)
	if err != nil {
		return fmt.Errorf("opencode: %w", err)
	}
	// bin is PREFIX/node_modules/.bin/opencode, a link to
	// PREFIX/node_modules/opencode-ai/bin/...; look beside either.
	var nm string
	for _, cand := range []string{filepath.Dir(filepath.Dir(bin)), filepath.Dir(filepath.Dir(filepath.Dir(real)))} {
		if _, err := os.Stat(filepath.Join(cand, pluginPkg, "package.json")); err == nil {
			nm = cand
			break
		}
	}
	if nm == "" {
		return nil
	}
	link := filepath.Join(cd, "node_modules")
	if err := os.Remove(link); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("opencode: %w", err)
	}
	if err := os.Symlink(nm, link); err != nil {
		return fmt.Errorf("opencode: %w", err)
	}
	for name, b := range pluginFiles(cd) {
		if err := os.WriteFile(name, b, 0o644); err != nil {
			return fmt.Errorf("opencode: %w", err)
		}
	}
	return nil
}

// pluginFiles are the files in config directory cd that declare
// @opencode-ai/plugin installed: what OpenCode checks, beside a
// node_modules directory, before it installs it.
func pluginFiles(cd string) map[string][]byte {
	deps := map[string]string{pluginPkg: Version}
	pkg, _ := json.Marshal(map[string]any{"dependencies": deps})
	lock, _ := json.Marshal(map[string]any{"lockfileVersion": 3, "packages": map[string]any{"": map[string]any{"dependencies": deps}}})
	return map[string][]byte{
		filepath.Join(cd, "package.json"):      append(pkg, '\n'),
		filepath.Join(cd, "package-lock.json"): append(lock, '\n'),
	}
}

// ConfigFiles are the files Prepare writes for an OpenCode directory dir,
// given Config's output, by absolute path, for writing elsewhere (inside a
// sandbox); PluginLink is then to point at the node_modules directory
// holding @opencode-ai/plugin.
func ConfigFiles(dir string, config []byte) (map[string][]byte, error) {
	if !filepath.IsAbs(dir) {
		return nil, fmt.Errorf("opencode: directory %q is not absolute", dir)
	}
	files := pluginFiles(configDir(dir))
	files[configFile(dir)] = config
	return files, nil
}

// PluginLink is the symlink in dir's config directory that must lead to a
// node_modules directory holding @opencode-ai/plugin.
func PluginLink(dir string) string { return filepath.Join(configDir(dir), "node_modules") }

// Env is the environment (to add to the inherited one) that confines
// OpenCode to dir: its XDG config, data, cache and state directories, the
// configuration Prepare wrote, no project opencode.json (a repository's
// own could point the model away from the relay), and no autoupdate,
// models.dev fetch, LSP download, sharing or Claude Code files.
func Env(dir string) []string {
	return []string{
		"XDG_CONFIG_HOME=" + filepath.Join(dir, "config"),
		"XDG_DATA_HOME=" + filepath.Join(dir, "data"),
		"XDG_CACHE_HOME=" + filepath.Join(dir, "cache"),
		"XDG_STATE_HOME=" + filepath.Join(dir, "state"),
		"OPENCODE_CONFIG=" + configFile(dir),
		"OPENCODE_DISABLE_PROJECT_CONFIG=1",
		"OPENCODE_DISABLE_AUTOUPDATE=1",
		"OPENCODE_DISABLE_MODELS_FETCH=1",
		"OPENCODE_DISABLE_LSP_DOWNLOAD=1",
		"OPENCODE_DISABLE_SHARE=1",
		"OPENCODE_DISABLE_CLAUDE_CODE=1",
	}
}

// Argv is `opencode run` for one prompt in workDir, non-interactive: it
// answers, runs its tools, and exits when the model gives a final answer.
// The session title is given, so OpenCode makes no model call to invent one.
func Argv(bin, workDir, prompt string) []string {
	return []string{bin, "run", "--pure", "--dir", workDir, "--title", "stasis episode", "--", prompt}
}

// Command is Argv with Env(dir) over the inherited environment, run in
// workDir; dir must have been Prepared.
func Command(bin, dir, workDir, prompt string) *exec.Cmd {
	a := Argv(bin, workDir, prompt)
	cmd := exec.Command(a[0], a[1:]...)
	cmd.Dir = workDir
	cmd.Env = append(os.Environ(), Env(dir)...)
	return cmd
}
