//! Compilation: raw documents -> [`CompiledWorkspace`]. Every check of SPEC section 3 lives
//! here: one Runtime, unique and well-formed names, resolved references, files that exist and
//! stay inside the workspace, durations (at most 30 days) and sizes, JSON Schemas,
//! backend-specific fields and tool implementations. So do the checks that keep trust honest:
//! a field this build parses but does not enforce is rejected ("not supported yet"), a rule
//! on client-supplied metadata may only tighten, delegation cycles are errors, redaction
//! patterns compile, and named keys have one identity each. Checks never stop early; each
//! problem becomes one diagnostic.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::diagnostics::{Diagnostic, Diagnostics, did_you_mean};
use super::located::Located;
use super::model::*;
use super::raw::{self, API_VERSION, ByteSizeText, DurationText, RetentionSpec};
use super::source::{Document, Documents, Origin};
use super::units::{
    DEFAULT_LEASE, MAX_DURATION, MAX_LEASE, MAX_RETENTION, MIN_LEASE, is_valid_env_var,
    is_valid_name, parse_byte_size, parse_duration,
};

/// Compiles the documents read from `root`; `None` when any diagnostic was reported.
pub fn compile(
    root: &Path,
    documents: Documents,
    diagnostics: &mut Diagnostics,
) -> Option<CompiledWorkspace> {
    let root = root.canonicalize().unwrap_or_else(|_| root.to_path_buf());
    let before = diagnostics.len();
    let mut compiler = Compiler {
        root: &root,
        diagnostics,
        unreadable: documents.unreadable_kinds.clone(),
    };
    for doc in &documents.runtimes {
        compiler.check_header(doc, "Runtime");
    }
    let inventory = Inventory::collect(&mut compiler, &documents);
    let models = compiler.models(&documents, &inventory);
    let tools = compiler.tools(&documents, &inventory);
    let runtime = compiler.runtime(&documents, &inventory);
    let memory = runtime.as_ref().map(|runtime| &runtime.memory);
    let agents = compiler.agents(&documents, &inventory, &tools, &models, memory);
    let (budgets, rate_limits) = compiler.spend(&documents, &inventory, &agents, &models);
    let runtime = runtime.map(|runtime| RuntimeConfig {
        budgets,
        rate_limits,
        ..runtime
    });
    compiler.delegation_cycles(&documents);
    let workflows = compiler.workflows(&documents, &inventory, &tools);
    if compiler.diagnostics.len() > before {
        return None;
    }
    Some(CompiledWorkspace {
        root,
        runtime: runtime?,
        agents,
        models,
        tools,
        workflows,
        loaded_at: chrono::Utc::now(),
        compile_time: std::time::Duration::ZERO,
    })
}

struct Compiler<'a> {
    root: &'a Path,
    diagnostics: &'a mut Diagnostics,
    unreadable: Vec<&'static str>,
}

/// The names every reference is resolved against, gathered before any reference is judged.
#[derive(Default)]
struct Inventory {
    agents: BTreeMap<String, String>,
    models: BTreeMap<String, String>,
    tools: BTreeMap<String, String>,
    mcp_servers: BTreeMap<String, String>,
}

impl Inventory {
    /// Registers names, reporting bad syntax and duplicates (with where the first one is).
    fn collect(compiler: &mut Compiler<'_>, documents: &Documents) -> Self {
        let mut inventory = Inventory::default();
        for doc in &documents.agents {
            compiler.check_header(doc, "Agent");
            compiler.register(
                &mut inventory.agents,
                "agent",
                &doc.origin,
                &doc.raw.metadata.name,
            );
        }
        for (kind, name) in &documents.unreadable_names {
            if *kind == "Agent" {
                inventory.agents.entry(name.clone()).or_default();
            }
        }
        let mut catalog_names = BTreeMap::new();
        for doc in &documents.model_catalogs {
            compiler.check_header(doc, "ModelCatalog");
            compiler.register(
                &mut catalog_names,
                "ModelCatalog",
                &doc.origin,
                &doc.raw.metadata.name,
            );
            for model in &doc.raw.spec.models {
                compiler.register(&mut inventory.models, "model", &doc.origin, &model.id);
            }
        }
        let mut catalog_names = BTreeMap::new();
        for doc in &documents.tool_catalogs {
            compiler.check_header(doc, "ToolCatalog");
            compiler.register(
                &mut catalog_names,
                "ToolCatalog",
                &doc.origin,
                &doc.raw.metadata.name,
            );
            for tool in &doc.raw.spec.tools {
                compiler.register(&mut inventory.tools, "tool", &doc.origin, &tool.id);
            }
        }
        let mut workflow_names = BTreeMap::new();
        for doc in &documents.workflows {
            compiler.check_header(doc, "Workflow");
            compiler.register(
                &mut workflow_names,
                "workflow",
                &doc.origin,
                &doc.raw.metadata.name,
            );
        }
        if let Some(doc) = documents.runtimes.first() {
            for server in &doc.raw.spec.mcp_servers {
                compiler.register(
                    &mut inventory.mcp_servers,
                    "MCP server",
                    &doc.origin,
                    &server.name,
                );
            }
        }
        inventory
    }
}

impl Compiler<'_> {
    fn report(&mut self, diagnostic: Diagnostic) {
        self.diagnostics.push(diagnostic);
    }

    fn check_header<S>(&mut self, doc: &Document<S>, kind: &str) {
        let version = &doc.raw.api_version;
        if version.value != API_VERSION {
            self.report(
                doc.origin
                    .at(
                        version,
                        format!("unsupported apiVersion `{}`", version.value),
                    )
                    .with_hint(format!("use `apiVersion: {API_VERSION}`")),
            );
        }
        if kind == "Runtime" {
            self.check_name(&doc.origin, &doc.raw.metadata.name, "Runtime");
        }
    }

    fn check_name(&mut self, origin: &Origin, name: &Located<String>, what: &str) -> bool {
        if is_valid_name(name) {
            return true;
        }
        let suggestion: String = name
            .to_lowercase()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        self.report(
            origin
                .at(
                    name,
                    format!(
                        "invalid {what} name `{}`: names match [a-z0-9][a-z0-9._-]*",
                        name.value
                    ),
                )
                .with_optional_hint(
                    is_valid_name(&suggestion).then(|| format!("did you mean `{suggestion}`?")),
                ),
        );
        false
    }

    /// Adds a name to `names` (name -> its location), reporting bad syntax and duplicates.
    fn register(
        &mut self,
        names: &mut BTreeMap<String, String>,
        what: &str,
        origin: &Origin,
        name: &Located<String>,
    ) {
        if !self.check_name(origin, name, what) {
            return;
        }
        if let Some(first) = names.get(&name.value) {
            let message = format!(
                "duplicate {what} `{}` (first defined at {first})",
                name.value
            );
            self.report(origin.at(name, message));
        } else {
            names.insert(name.value.clone(), origin.describe(name));
        }
    }

    /// Checks a reference to a named thing, with a did-you-mean hint when it dangles.
    fn reference(
        &mut self,
        origin: &Origin,
        reference: &Located<String>,
        names: &BTreeMap<String, String>,
        what: &str,
        kind: &'static str,
    ) -> bool {
        if names.contains_key(&reference.value) {
            return true;
        }
        if self.unreadable.contains(&kind) {
            // A document of that kind failed to parse; its names are unknown, so stay quiet.
            return false;
        }
        let hint = did_you_mean(&reference.value, names.keys().map(String::as_str)).or_else(|| {
            (names.is_empty()).then(|| format!("no {what} is declared in the workspace"))
        });
        self.report(
            origin
                .at(reference, format!("unknown {what} `{}`", reference.value))
                .with_optional_hint(hint),
        );
        false
    }

    /// A field that parses but that this build does not enforce yet: accepting it silently
    /// would promise behaviour that does not exist, so it is an error at its position.
    fn not_supported<T>(&mut self, origin: &Origin, at: &Located<T>, field: &str, hint: &str) {
        self.report(
            origin
                .at(at, format!("`{field}` is not supported yet"))
                .with_hint(hint.to_owned()),
        );
    }

    fn duration(
        &mut self,
        origin: &Origin,
        value: &Option<Located<DurationText>>,
        default: Duration,
        field: &str,
    ) -> Duration {
        self.duration_up_to(origin, value, default, field, MAX_DURATION)
    }

    fn duration_up_to(
        &mut self,
        origin: &Origin,
        value: &Option<Located<DurationText>>,
        default: Duration,
        field: &str,
        max: Duration,
    ) -> Duration {
        let Some(text) = value else { return default };
        match parse_duration(&text.0) {
            Ok(duration) if duration.is_zero() => {
                self.report(origin.at(text, format!("`{field}` must be greater than zero")));
                default
            }
            Ok(duration) if duration > max => {
                let limit = if max.as_secs().is_multiple_of(86_400) {
                    format!("{}-day", max.as_secs() / 86_400)
                } else {
                    format!("{}s", max.as_secs())
                };
                self.report(origin.at(
                    text,
                    format!(
                        "`{field}` ({}) is longer than the {limit} maximum",
                        text.0.trim()
                    ),
                ));
                default
            }
            Ok(duration) => duration,
            Err(message) => {
                self.report(origin.at(text, format!("`{field}`: {message}")));
                default
            }
        }
    }

    fn byte_size(
        &mut self,
        origin: &Origin,
        value: &Option<Located<ByteSizeText>>,
        default: u64,
        field: &str,
    ) -> u64 {
        let Some(text) = value else { return default };
        match parse_byte_size(&text.0) {
            Ok(0) => {
                self.report(origin.at(text, format!("`{field}` must be greater than zero")));
                default
            }
            Ok(size) => size,
            Err(message) => {
                self.report(origin.at(text, format!("`{field}`: {message}")));
                default
            }
        }
    }

    fn env_var(&mut self, origin: &Origin, name: &Located<String>, field: &str) -> String {
        if !is_valid_env_var(name) {
            self.report(
                origin
                    .at(name, format!("`{field}` must name an environment variable, got `{}`", name.value))
                    .with_hint("fields ending in `Env` hold a variable name such as OPENAI_API_KEY, never the secret itself"),
            );
        }
        name.value.clone()
    }

    fn env_vars(&mut self, origin: &Origin, names: &[Located<String>], field: &str) -> Vec<String> {
        names
            .iter()
            .map(|name| self.env_var(origin, name, field))
            .collect()
    }

    fn http_url(&mut self, origin: &Origin, url: &Located<String>, field: &str) -> String {
        let ok = ["http://", "https://"]
            .iter()
            .any(|scheme| url.len() > scheme.len() && url.to_ascii_lowercase().starts_with(scheme));
        if !ok || url.contains(char::is_whitespace) {
            self.report(origin.at(
                url,
                format!(
                    "`{field}` must be an http:// or https:// URL, got `{}`",
                    url.value
                ),
            ));
        }
        url.value.clone()
    }

    fn memory(&mut self, origin: &Origin, spec: &raw::MemorySpec) -> MemoryConfig {
        let max_content_bytes = self.byte_size(
            origin,
            &spec.write.max_content_bytes,
            DEFAULT_MEMORY_CONTENT_BYTES,
            "memory.write.maxContentBytes",
        );
        if let Some(size) = &spec.write.max_content_bytes
            && max_content_bytes > MAX_MEMORY_CONTENT_BYTES
        {
            self.report(origin.at(
                size,
                format!(
                    "`memory.write.maxContentBytes` is larger than {MAX_MEMORY_CONTENT_BYTES} bytes"
                ),
            ));
        }
        let ttl = spec.ttl.as_ref().map(|_| {
            self.duration_up_to(
                origin,
                &spec.ttl,
                Duration::ZERO,
                "memory.ttl",
                MAX_RETENTION,
            )
        });
        let mut names = BTreeMap::new();
        let providers = spec
            .providers
            .iter()
            .map(|provider| {
                self.register(&mut names, "memory provider", origin, &provider.name);
                MemoryProviderConfig {
                    name: provider.name.value.clone(),
                    url: self.http_url(origin, &provider.url, "memory.providers.url"),
                    api_key_env: provider
                        .api_key_env
                        .as_ref()
                        .map(|env| self.env_var(origin, env, "apiKeyEnv")),
                    timeout: self.duration_up_to(
                        origin,
                        &provider.timeout,
                        Duration::from_secs(2),
                        "memory.providers.timeout",
                        Duration::from_secs(60),
                    ),
                }
            })
            .collect();
        MemoryConfig {
            enabled: spec.enabled.as_ref().is_some_and(|enabled| enabled.value),
            write_requires_approval: spec.write.require_approval.unwrap_or(true),
            max_content_bytes: usize::try_from(max_content_bytes.min(MAX_MEMORY_CONTENT_BYTES))
                .unwrap_or(usize::MAX),
            ttl,
            providers,
        }
    }

    fn agent_memory(
        &mut self,
        origin: &Origin,
        spec: &Located<raw::AgentMemorySpec>,
        runtime: Option<&MemoryConfig>,
    ) -> AgentMemoryConfig {
        match runtime {
            Some(runtime) if !runtime.enabled => self.report(
                origin
                    .at(spec, "agent `memory` needs memory enabled in the Runtime")
                    .with_hint("set `memory: { enabled: true }` in the Runtime's spec"),
            ),
            _ => {}
        }
        let mut namespaces = Vec::new();
        for template in spec.namespace.iter().chain(&spec.namespaces) {
            match crate::memory::check_template(template) {
                Ok(()) if namespaces.contains(&template.value) => self.report(origin.at(
                    template,
                    format!("namespace `{}` is listed twice", template.value),
                )),
                Ok(()) => namespaces.push(template.value.clone()),
                Err(message) => self.report(origin.at(template, message)),
            }
        }
        if spec.namespace.is_none() && spec.namespaces.is_empty() {
            namespaces.push("agent/{agentId}".to_owned());
        }
        let max_recall = match &spec.max_recall {
            Some(max) if !(1..=MAX_RECALL).contains(&max.value) => {
                self.report(origin.at(
                    max,
                    format!(
                        "`memory.maxRecall` must be 1 to {MAX_RECALL}, got {}",
                        max.value
                    ),
                ));
                DEFAULT_RECALL
            }
            Some(max) => max.value,
            None => DEFAULT_RECALL,
        };
        if let (Some(provider), Some(runtime)) = (&spec.provider, runtime) {
            let names = runtime
                .providers
                .iter()
                .map(|p| (p.name.clone(), String::new()))
                .collect();
            self.reference(origin, provider, &names, "memory provider", "Runtime");
        }
        AgentMemoryConfig {
            namespaces,
            recall: spec.recall.unwrap_or(true),
            max_recall,
            provider: spec.provider.as_ref().map(|p| p.value.clone()),
        }
    }

    fn retention(&mut self, origin: &Origin, spec: &RetentionSpec) -> RetentionConfig {
        let defaults = RetentionConfig::default();
        let requests = spec.requests.as_ref().map(|_| {
            self.duration_up_to(
                origin,
                &spec.requests,
                MAX_RETENTION,
                "store.retention.requests",
                MAX_RETENTION,
            )
        });
        let every = self.duration(origin, &spec.every, defaults.every, "store.retention.every");
        let archive_dir = spec.archive.as_ref().and_then(|archive| {
            self.workspace_folder(origin, &archive.dir, "store.retention.archive.dir")
        });
        RetentionConfig {
            requests,
            min_keep: spec
                .min_keep
                .as_ref()
                .map_or(defaults.min_keep, |n| n.value),
            every,
            archive_dir,
        }
    }

    /// Resolves a workspace-relative folder that may not exist yet, refusing `..`, absolute
    /// paths and (when it exists) symlink escapes.
    fn workspace_folder(
        &mut self,
        origin: &Origin,
        path: &Located<String>,
        field: &str,
    ) -> Option<PathBuf> {
        let relative = Path::new(&path.value);
        let escapes = path.is_empty()
            || relative.is_absolute()
            || relative
                .components()
                .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir));
        let joined = self.root.join(relative);
        let through_link = joined
            .canonicalize()
            .is_ok_and(|resolved| !resolved.starts_with(self.root));
        if escapes || through_link {
            self.report(
                origin
                    .at(path, format!("`{field}` path `{}` escapes the workspace", path.value))
                    .with_hint("paths are relative to the workspace folder and may not use `..`, start with `/` or lead out through a link"),
            );
            return None;
        }
        Some(joined)
    }

    /// Resolves a workspace-relative file path, refusing `..`, absolute paths and symlink escapes.
    fn workspace_file(
        &mut self,
        origin: &Origin,
        path: &Located<String>,
        field: &str,
        under: Option<&str>,
    ) -> Option<PathBuf> {
        let relative = Path::new(&path.value);
        if path.is_empty()
            || relative.is_absolute()
            || relative
                .components()
                .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
        {
            self.report(
                origin
                    .at(path, format!("`{field}` path `{}` escapes the workspace", path.value))
                    .with_hint("paths are relative to the workspace folder and may not use `..` or start with `/`"),
            );
            return None;
        }
        if let Some(prefix) = under
            && !relative.starts_with(prefix)
        {
            self.report(
                origin
                    .at(
                        path,
                        format!("`{field}` path `{}` must be under {prefix}/", path.value),
                    )
                    .with_hint(format!("write `{prefix}/{}`", path.value)),
            );
            return None;
        }
        let joined = self.root.join(relative);
        let resolved = match joined.canonicalize() {
            Ok(resolved) => resolved,
            Err(_) => {
                self.report(origin.at(
                    path,
                    format!(
                        "`{field}`: file `{}` not found in the workspace",
                        path.value
                    ),
                ));
                return None;
            }
        };
        if !resolved.starts_with(self.root) {
            self.report(origin.at(
                path,
                format!(
                    "`{field}` path `{}` leads outside the workspace through a symbolic link",
                    path.value
                ),
            ));
            return None;
        }
        if !resolved.is_file() {
            self.report(origin.at(path, format!("`{field}`: `{}` is not a file", path.value)));
            return None;
        }
        Some(resolved)
    }

    fn read_small_file(
        &mut self,
        origin: &Origin,
        path: &Located<String>,
        file: &Path,
        field: &str,
    ) -> Option<String> {
        let size = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
        if size > super::source::MAX_FILE_BYTES {
            self.report(origin.at(
                path,
                format!("`{field}`: `{}` is larger than 4 MiB", path.value),
            ));
            return None;
        }
        match std::fs::read(file).map(String::from_utf8) {
            Ok(Ok(text)) => Some(text),
            Ok(Err(_)) => {
                self.report(origin.at(
                    path,
                    format!("`{field}`: `{}` is not valid UTF-8", path.value),
                ));
                None
            }
            Err(error) => {
                self.report(origin.at(
                    path,
                    format!("`{field}`: cannot read `{}`: {error}", path.value),
                ));
                None
            }
        }
    }

    /// A program to run: a workspace file that is executable, or (when `allow_path_lookup`) a
    /// bare program name looked up on PATH at start.
    fn program(
        &mut self,
        origin: &Origin,
        program: &Located<String>,
        args: &[String],
        env: &[Located<String>],
        allow_path_lookup: bool,
    ) -> CommandConfig {
        let env = self.env_vars(origin, env, "env");
        let bare = !program.contains('/');
        let resolved = if bare && allow_path_lookup && !program.is_empty() {
            PathBuf::from(&program.value)
        } else {
            let resolved = self.workspace_file(origin, program, "program", None);
            if let Some(path) = &resolved
                && !is_executable(path)
            {
                self.report(
                    origin
                        .at(
                            program,
                            format!("program `{}` is not executable", program.value),
                        )
                        .with_hint(format!("chmod +x {}", program.value)),
                );
            }
            resolved.unwrap_or_default()
        };
        CommandConfig {
            program: resolved,
            args: args.to_vec(),
            env,
        }
    }

    // -----------------------------------------------------------------------------------------

    fn models(
        &mut self,
        documents: &Documents,
        inventory: &Inventory,
    ) -> BTreeMap<String, ModelConfig> {
        let mut models = BTreeMap::new();
        for doc in &documents.model_catalogs {
            let origin = &doc.origin;
            for spec in &doc.raw.spec.models {
                let base_url = match (&spec.base_url, &spec.base_url_env) {
                    (Some(url), None) => UpstreamUrl::Fixed(self.http_url(origin, url, "baseUrl")),
                    (None, Some(env)) => {
                        UpstreamUrl::FromEnv(self.env_var(origin, env, "baseUrlEnv"))
                    }
                    (Some(url), Some(_)) => {
                        self.report(origin.at(
                            url,
                            format!(
                                "model `{}` sets both `baseUrl` and `baseUrlEnv`; keep one",
                                spec.id.value
                            ),
                        ));
                        UpstreamUrl::Fixed(url.value.clone())
                    }
                    (None, None) => {
                        self.report(
                            origin
                                .at(
                                    &spec.id,
                                    format!(
                                        "model `{}` needs `baseUrl` or `baseUrlEnv`",
                                        spec.id.value
                                    ),
                                )
                                .with_hint("e.g. `baseUrlEnv: OPENAI_BASE_URL`"),
                        );
                        UpstreamUrl::Fixed(String::new())
                    }
                };
                if spec.upstream_model.trim().is_empty() {
                    self.report(
                        origin.at(&spec.upstream_model, "`upstreamModel` must not be empty"),
                    );
                }
                let api_key_env = spec
                    .api_key_env
                    .as_ref()
                    .map(|env| self.env_var(origin, env, "apiKeyEnv"));
                let pricing = spec.pricing.as_ref().map(|pricing| {
                    for price in [&pricing.input_per_m_tok, &pricing.output_per_m_tok] {
                        if !(price.value.is_finite() && price.value >= 0.0) {
                            self.report(
                                origin.at(price, "prices must be zero or positive numbers"),
                            );
                        }
                    }
                    Pricing {
                        input_per_m_tok: pricing.input_per_m_tok.value,
                        output_per_m_tok: pricing.output_per_m_tok.value,
                    }
                });
                for fallback in &spec.fallbacks {
                    if fallback.value == spec.id.value {
                        self.report(origin.at(
                            fallback,
                            format!("model `{}` lists itself as a fallback", spec.id.value),
                        ));
                    } else {
                        self.reference(
                            origin,
                            fallback,
                            &inventory.models,
                            "model",
                            "ModelCatalog",
                        );
                    }
                }
                let timeout =
                    self.duration(origin, &spec.timeout, Duration::from_secs(60), "timeout");
                let capabilities = ModelCapabilities {
                    tools: spec.capabilities.tools.unwrap_or(true),
                    streaming: spec.capabilities.streaming.unwrap_or(true),
                    vision: spec.capabilities.vision.unwrap_or(false),
                    json_schema: spec.capabilities.json_schema.unwrap_or(false),
                };
                models.entry(spec.id.value.clone()).or_insert(ModelConfig {
                    id: spec.id.value.clone(),
                    provider: spec.provider,
                    base_url,
                    api_key_env,
                    upstream_model: spec.upstream_model.value.clone(),
                    capabilities,
                    context_window: spec.context_window,
                    pricing,
                    max_output_tokens: spec.max_output_tokens.as_ref().map(|max| {
                        if max.value == 0 {
                            self.report(origin.at(max, "`maxOutputTokens` must be at least 1"));
                        }
                        max.value
                    }),
                    timeout,
                    fallbacks: spec.fallbacks.iter().map(|f| f.value.clone()).collect(),
                });
            }
        }
        models
    }

    fn tools(
        &mut self,
        documents: &Documents,
        inventory: &Inventory,
    ) -> BTreeMap<String, ToolConfig> {
        let mut tools = BTreeMap::new();
        for doc in &documents.tool_catalogs {
            for spec in &doc.raw.spec.tools {
                if let Some(tool) = self.tool(&doc.origin, spec, inventory) {
                    tools.entry(tool.id.clone()).or_insert(tool);
                }
            }
        }
        tools
    }

    fn tool(
        &mut self,
        origin: &Origin,
        spec: &raw::ToolSpec,
        inventory: &Inventory,
    ) -> Option<ToolConfig> {
        let id = &spec.id.value;
        if id.starts_with(DELEGATION_PREFIX) {
            self.report(
                origin
                    .at(&spec.id, format!("tool id `{id}` is reserved: `{DELEGATION_PREFIX}<name>` names delegation to an agent"))
                    .with_hint("give the tool another id; list the agent in `subagents` to delegate to it"),
            );
        }
        if id.starts_with(CLIENT_TOOL_PREFIX) {
            self.report(
                origin
                    .at(&spec.id, format!("tool id `{id}` is reserved: `{CLIENT_TOOL_PREFIX}<name>` names a tool the client supplies"))
                    .with_hint("give the tool another id"),
            );
        }
        let timeout = self.duration(origin, &spec.timeout, Duration::from_secs(30), "timeout");
        let (input_schema, input_validator) = self.input_schema(origin, spec)?;
        let declared: Vec<&str> = [
            spec.http.as_ref().map(|_| "http"),
            spec.command.as_ref().map(|_| "command"),
            spec.mcp.as_ref().map(|_| "mcp"),
            spec.builtin.as_ref().map(|_| "builtin"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if declared.len() != 1 {
            let message = if declared.is_empty() {
                format!("tool `{id}` has no implementation")
            } else {
                format!(
                    "tool `{id}` has {} implementations ({}); a tool has exactly one",
                    declared.len(),
                    declared.join(", ")
                )
            };
            self.report(
                origin
                    .at(&spec.id, message)
                    .with_hint("give exactly one of `http`, `command`, `mcp`, `builtin`"),
            );
            return None;
        }
        let implementation = if let Some(http) = &spec.http {
            let headers_env = http
                .headers_env
                .iter()
                .map(|(header, env)| (header.clone(), self.env_var(origin, env, "headersEnv")))
                .collect();
            ToolImplementation::Http {
                method: http.method.unwrap_or(HttpMethod::Post),
                url: self.http_url(origin, &http.url, "url"),
                headers_env,
                max_response_bytes: self.byte_size(
                    origin,
                    &http.max_response_bytes,
                    1 << 20,
                    "maxResponseBytes",
                ),
            }
        } else if let Some(command) = &spec.command {
            ToolImplementation::Command {
                command: self.program(origin, &command.program, &command.args, &command.env, false),
                max_output_bytes: self.byte_size(
                    origin,
                    &command.max_output_bytes,
                    1 << 20,
                    "maxOutputBytes",
                ),
            }
        } else if let Some(mcp) = &spec.mcp {
            self.reference(
                origin,
                &mcp.server,
                &inventory.mcp_servers,
                "MCP server",
                "Runtime",
            );
            ToolImplementation::Mcp {
                server: mcp.server.value.clone(),
                tool: mcp.tool.clone(),
                // The same default bound as command output: a result is model input either way.
                max_output_bytes: self.byte_size(
                    origin,
                    &mcp.max_output_bytes,
                    1 << 20,
                    "maxOutputBytes",
                ),
            }
        } else if let Some(builtin) = &spec.builtin {
            match BuiltinTool::parse(builtin) {
                Some(tool) => ToolImplementation::Builtin(tool),
                None => {
                    let names = BuiltinTool::ALL.map(|(name, _)| name);
                    let hint = did_you_mean(builtin, names)
                        .unwrap_or_else(|| format!("built-in tools: {}", names.join(", ")));
                    self.report(
                        origin
                            .at(
                                builtin,
                                format!("unknown built-in tool `{}`", builtin.value),
                            )
                            .with_hint(hint),
                    );
                    return None;
                }
            }
        } else {
            return None;
        };
        let risk = spec.risk.unwrap_or(Risk::Low);
        // A high-risk call is never re-run silently after a crash unless the tool says so.
        let on_interrupted = spec.on_interrupted.unwrap_or(if risk == Risk::High {
            InterruptedAction::Ask
        } else {
            InterruptedAction::Rerun
        });
        Some(ToolConfig {
            id: id.clone(),
            description: spec.description.clone(),
            input_schema,
            input_validator,
            risk,
            labels: spec.labels.clone(),
            timeout,
            on_interrupted,
            implementation,
        })
    }

    /// The tool's argument schema, checked to be a valid JSON Schema describing an object.
    fn input_schema(
        &mut self,
        origin: &Origin,
        spec: &raw::ToolSpec,
    ) -> Option<(serde_json::Value, Arc<jsonschema::Validator>)> {
        let schema = match &spec.input_schema {
            Some(schema) => schema.clone(),
            None => {
                let builtin = spec.builtin.as_ref().and_then(|b| BuiltinTool::parse(b));
                let default = builtin.map_or_else(
                    || serde_json::json!({ "type": "object" }),
                    BuiltinTool::input_schema,
                );
                Located::new(default, spec.id.position)
            }
        };
        let describes_object = match schema.get("type") {
            Some(serde_json::Value::String(kind)) => kind == "object",
            _ => false,
        };
        if !describes_object {
            self.report(
                origin
                    .at(
                        &schema,
                        format!(
                            "tool `{}`: `inputSchema` must describe an object (`type: object`)",
                            spec.id.value
                        ),
                    )
                    .with_hint("tool arguments are a JSON object, as in OpenAI function calling"),
            );
            return None;
        }
        match jsonschema::validator_for(&schema) {
            Ok(validator) => Some((schema.value, Arc::new(validator))),
            Err(error) => {
                let at = error.instance_path().to_string();
                let place = if at.is_empty() {
                    String::new()
                } else {
                    format!(" at `{at}`")
                };
                self.report(origin.at(
                    &schema,
                    format!(
                        "tool `{}`: invalid JSON Schema{place}: {error}",
                        spec.id.value
                    ),
                ));
                None
            }
        }
    }

    fn runtime(&mut self, documents: &Documents, inventory: &Inventory) -> Option<RuntimeConfig> {
        let doc = match documents.runtimes.as_slice() {
            [] => {
                if !self.unreadable.contains(&"Runtime") && documents.files_read > 0 {
                    self.report(
                        Diagnostic::whole(
                            "config/",
                            "no Runtime document found; a workspace has exactly one",
                        )
                        .with_hint("add config/runtime/workspace.yaml with `kind: Runtime`"),
                    );
                }
                return None;
            }
            [first, rest @ ..] => {
                for extra in rest {
                    let message = format!(
                        "a workspace has exactly one Runtime; another is at {}",
                        first.origin.describe(&first.raw.kind)
                    );
                    self.report(extra.origin.at(&extra.raw.kind, message));
                }
                first
            }
        };
        let origin = &doc.origin;
        let spec = &doc.raw.spec;
        let default_agent = match &spec.default_agent {
            Some(agent) => {
                self.reference(origin, agent, &inventory.agents, "agent", "Agent");
                Some(agent.value.clone())
            }
            None if inventory.agents.len() == 1 => inventory.agents.keys().next().cloned(),
            None => None,
        };
        let store_url = match &spec.store {
            Some(store) => {
                if let Some(url) = &store.url
                    && !["sqlite:", "postgres://", "postgresql://"]
                        .iter()
                        .any(|p| url.starts_with(p))
                {
                    self.report(
                        origin
                            .at(
                                url,
                                format!(
                                    "unsupported store url `{}`",
                                    crate::store::redact_url(&url.value)
                                ),
                            )
                            .with_hint("use sqlite://PATH or postgres://USER@HOST/DB"),
                    );
                }
                store.url.as_ref().map(|u| u.value.clone())
            }
            None => None,
        };
        let lease_duration = match spec.store.as_ref().map(|store| &store.lease_duration) {
            Some(lease @ Some(text)) => {
                let duration = self.duration_up_to(
                    origin,
                    lease,
                    DEFAULT_LEASE,
                    "store.leaseDuration",
                    MAX_LEASE,
                );
                if duration < MIN_LEASE {
                    self.report(
                        origin
                            .at(text, "`store.leaseDuration` must be at least 1s")
                            .with_hint("a lease is renewed every third of it; shorter ones would be lost to a slow database"),
                    );
                    DEFAULT_LEASE
                } else {
                    duration
                }
            }
            _ => DEFAULT_LEASE,
        };
        let store_max_bytes = spec.store.as_ref().and_then(|store| {
            store
                .max_size
                .as_ref()
                .map(|_| self.byte_size(origin, &store.max_size, u64::MAX, "store.maxSize"))
        });
        let retention = match spec.store.as_ref().and_then(|s| s.retention.as_ref()) {
            Some(retention) => self.retention(origin, retention),
            None => RetentionConfig::default(),
        };
        let (client_keys, admin_keys) = self.keys(origin, &spec.protocols);
        let openai = OpenAiProtocolConfig {
            enabled: spec.protocols.openai.enabled.unwrap_or(true),
            api_keys_env: self.env_vars(origin, &spec.protocols.openai.api_keys_env, "apiKeysEnv"),
            keys: client_keys,
            approval_wait: self.duration(
                origin,
                &spec.protocols.openai.approval_wait,
                Duration::from_secs(120),
                "approvalWait",
            ),
        };
        let admin_api_keys_env =
            self.env_vars(origin, &spec.protocols.admin.api_keys_env, "apiKeysEnv");
        // A parked run is a task holding its transcript: bounded like any queue.
        const DEFAULT_PARKED_RUNS: u32 = 1_000;
        const MAX_PARKED_RUNS: u32 = 1_000_000;
        let max_concurrent_runs = match &spec.limits.max_concurrent_runs {
            Some(limit) if limit.value == 0 => {
                self.report(origin.at(limit, "`maxConcurrentRuns` must be at least 1"));
                256
            }
            Some(limit) => limit.value,
            None => 256,
        };
        let max_parked_runs = match &spec.limits.max_parked_runs {
            Some(limit) if limit.value > MAX_PARKED_RUNS => {
                self.report(origin.at(
                    limit,
                    format!("`maxParkedRuns` must be at most {MAX_PARKED_RUNS}"),
                ));
                DEFAULT_PARKED_RUNS
            }
            Some(limit) => limit.value,
            None => DEFAULT_PARKED_RUNS,
        };
        let limits = LimitsConfig {
            max_parked_runs,
            max_request_bytes: self.byte_size(
                origin,
                &spec.limits.max_request_bytes,
                4 << 20,
                "maxRequestBytes",
            ),
            max_concurrent_runs,
            max_output_bytes: self.byte_size(
                origin,
                &spec.limits.max_output_bytes,
                1 << 20,
                "maxOutputBytes",
            ),
            kept_history_bytes: self.byte_size(
                origin,
                &spec.limits.kept_history_bytes,
                crate::runtime::DEFAULT_KEPT_HISTORY_BYTES,
                "keptHistoryBytes",
            ),
        };
        let governance = self.governance(origin, &spec.governance, inventory);
        let recovery = self.recovery(origin, &spec.recovery);
        let memory = self.memory(origin, &spec.memory);
        let mut cli_event_types = Vec::new();
        for event_type in &spec.cli.events.include {
            if crate::runtime::events::EVENT_TYPES.contains(&event_type.as_str()) {
                cli_event_types.push(event_type.value.clone());
            } else {
                let hint = did_you_mean(
                    event_type,
                    crate::runtime::events::EVENT_TYPES.iter().copied(),
                );
                self.report(
                    origin
                        .at(
                            event_type,
                            format!("unknown event type `{}`", event_type.value),
                        )
                        .with_optional_hint(hint),
                );
            }
        }
        let mut mcp_servers = BTreeMap::new();
        for server in &spec.mcp_servers {
            let transport = match (&server.command, &server.url) {
                (Some(command), None) => McpTransport::Stdio(self.program(
                    origin,
                    &command.program,
                    &command.args,
                    &command.env,
                    true,
                )),
                (None, Some(url)) => McpTransport::Http {
                    url: self.http_url(origin, url, "url"),
                    headers_env: server
                        .headers_env
                        .iter()
                        .map(|(header, env)| {
                            (header.clone(), self.env_var(origin, env, "headersEnv"))
                        })
                        .collect(),
                },
                _ => {
                    self.report(
                        origin
                            .at(&server.name, format!("MCP server `{}` needs exactly one of `command` (stdio) or `url` (streamable HTTP)", server.name.value)),
                    );
                    continue;
                }
            };
            let timeout =
                self.duration(origin, &server.timeout, Duration::from_secs(30), "timeout");
            mcp_servers
                .entry(server.name.value.clone())
                .or_insert(McpServerConfig {
                    name: server.name.value.clone(),
                    transport,
                    timeout,
                });
        }
        Some(RuntimeConfig {
            name: doc.raw.metadata.name.value.clone(),
            labels: doc.raw.metadata.labels.clone(),
            default_agent,
            store_url,
            lease_duration,
            store_max_bytes,
            retention,
            openai,
            admin_api_keys_env,
            admin_keys,
            limits,
            governance,
            recovery,
            memory,
            budgets: Vec::new(),
            rate_limits: Vec::new(),
            narration: NarrationConfig {
                enabled: spec.progress.narration.enabled.unwrap_or(false),
                style: spec
                    .progress
                    .narration
                    .style
                    .unwrap_or(NarrationStyle::Concise),
            },
            cli_event_types,
            mcp_servers,
        })
    }

    /// Named keys of both surfaces. Names are identities, unique across client and admin keys;
    /// a variable may back only one key of a surface, so a presented key has one identity.
    fn keys(
        &mut self,
        origin: &Origin,
        spec: &raw::ProtocolsSpec,
    ) -> (Vec<KeyConfig>, Vec<KeyConfig>) {
        let mut names = BTreeMap::new();
        let client = spec
            .openai
            .keys
            .iter()
            .map(|key| (&key.name, &key.key_env, Some(&key.labels)));
        let client = self.key_list(origin, &mut names, client, &spec.openai.api_keys_env);
        let admin = spec
            .admin
            .keys
            .iter()
            .map(|key| (&key.name, &key.key_env, None));
        let admin = self.key_list(origin, &mut names, admin, &spec.admin.api_keys_env);
        (client, admin)
    }

    fn key_list<'k>(
        &mut self,
        origin: &Origin,
        names: &mut BTreeMap<String, String>,
        keys: impl Iterator<
            Item = (
                &'k Located<String>,
                &'k Located<String>,
                Option<&'k BTreeMap<String, String>>,
            ),
        >,
        unnamed: &[Located<String>],
    ) -> Vec<KeyConfig> {
        let mut variables: BTreeMap<String, String> = unnamed
            .iter()
            .map(|variable| (variable.value.clone(), "`apiKeysEnv`".to_owned()))
            .collect();
        let mut compiled = Vec::new();
        for (name, key_env, labels) in keys {
            self.register(names, "API key", origin, name);
            let variable = self.env_var(origin, key_env, "keyEnv");
            if let Some(user) = variables.get(&variable) {
                self.report(
                    origin
                        .at(
                            key_env,
                            format!("`keyEnv` {variable} is already used by {user}"),
                        )
                        .with_hint("one variable backs one key, so that a key has one identity"),
                );
            } else {
                variables.insert(variable.clone(), format!("key `{}`", name.value));
            }
            compiled.push(KeyConfig {
                name: name.value.clone(),
                key_env: variable,
                labels: labels.cloned().unwrap_or_default(),
            });
        }
        compiled
    }

    fn governance(
        &mut self,
        origin: &Origin,
        spec: &raw::GovernanceSpec,
        inventory: &Inventory,
    ) -> GovernanceConfig {
        let mut rule_names = BTreeMap::new();
        let mut rules = Vec::new();
        // Delegation tools `agents.<name>` are built by the gateway for every agent; rules
        // may name them like catalog tools.
        let delegations: BTreeMap<String, String> = inventory
            .agents
            .iter()
            .map(|(name, at)| (format!("{DELEGATION_PREFIX}{name}"), at.clone()))
            .collect();
        for rule in &spec.rules {
            self.register(&mut rule_names, "governance rule", origin, &rule.name);
            for pattern in &rule.matches.tools {
                if pattern.starts_with(CLIENT_TOOL_PREFIX) {
                    // Client tools arrive with each request: any name may be governed.
                } else if pattern.contains('*') {
                    let matches_any = inventory
                        .tools
                        .keys()
                        .chain(delegations.keys())
                        .any(|tool| glob_matches(pattern, tool));
                    let unknown = self.unreadable.contains(&"ToolCatalog")
                        || self.unreadable.contains(&"Agent");
                    if !matches_any && !unknown {
                        self.report(origin.at(
                            pattern,
                            format!("tool pattern `{}` matches no tool", pattern.value),
                        ));
                    }
                } else if pattern.starts_with(DELEGATION_PREFIX) {
                    self.reference(origin, pattern, &delegations, "delegation tool", "Agent");
                } else {
                    self.reference(origin, pattern, &inventory.tools, "tool", "ToolCatalog");
                }
            }
            for agent in &rule.matches.agents {
                self.reference(origin, agent, &inventory.agents, "agent", "Agent");
            }
            let metadata = rule
                .matches
                .metadata
                .as_ref()
                .map(|m| m.value.clone())
                .unwrap_or_default();
            if let Some(at) = &rule.matches.metadata
                && !at.is_empty()
                && rule.decision == Decision::Allow
            {
                self.report(
                    origin
                        .at(
                            at,
                            format!(
                                "rule `{}` decides allow on client-supplied request metadata; such rules may only deny or ask for approval",
                                rule.name.value
                            ),
                        )
                        .with_hint("decide `deny` or `needs_approval`, or match trusted `labels` (tool, agent, key, runtime) instead"),
                );
            }
            rules.push(PolicyRule {
                name: rule.name.value.clone(),
                tools: rule.matches.tools.iter().map(|t| t.value.clone()).collect(),
                agents: rule
                    .matches
                    .agents
                    .iter()
                    .map(|a| a.value.clone())
                    .collect(),
                risk: rule.matches.risk.clone(),
                labels: rule.matches.labels.clone(),
                metadata,
                decision: rule.decision,
                reason: rule.reason.clone(),
            });
        }
        GovernanceConfig {
            default: spec.default.unwrap_or(Decision::Allow),
            rules,
            approval_timeout: self.duration(
                origin,
                &spec.approvals.timeout,
                Duration::from_secs(86_400),
                "approvals.timeout",
            ),
            on_timeout: spec.approvals.on_timeout.unwrap_or(TimeoutAction::Deny),
            policy_timeout: self.duration(
                origin,
                &spec.policy_timeout,
                Duration::from_secs(5),
                "policyTimeout",
            ),
            redact_patterns: spec
                .redact
                .patterns
                .iter()
                .filter_map(|pattern| self.redact_pattern(origin, pattern))
                .collect(),
        }
    }

    /// One secret pattern, compiled with a size limit so a hostile or careless pattern
    /// cannot blow up memory; one that matches the empty string would redact nothing useful
    /// and mangle every text, so it is refused too.
    fn redact_pattern(
        &mut self,
        origin: &Origin,
        pattern: &Located<String>,
    ) -> Option<regex::Regex> {
        let problem = match regex::RegexBuilder::new(pattern)
            .size_limit(REDACT_PATTERN_SIZE_LIMIT)
            .build()
        {
            Ok(regex) if regex.is_match("") => "it matches the empty string".to_owned(),
            Ok(regex) => return Some(regex),
            Err(regex::Error::CompiledTooBig(_)) => format!(
                "it compiles to more than the {} KiB limit",
                REDACT_PATTERN_SIZE_LIMIT >> 10
            ),
            Err(error) => {
                // The syntax error quotes the pattern over several lines; keep its last line.
                let text = error.to_string();
                text.lines()
                    .rev()
                    .find(|line| !line.trim().is_empty())
                    .unwrap_or_default()
                    .trim()
                    .trim_start_matches("error: ")
                    .to_owned()
            }
        };
        self.report(origin.at(
            pattern,
            format!(
                "`redact.patterns`: invalid pattern `{}`: {problem}",
                pattern.value
            ),
        ));
        None
    }

    fn recovery(&mut self, origin: &Origin, spec: &raw::RecoverySpec) -> RecoveryConfig {
        let max_attempts = match &spec.max_attempts {
            Some(attempts) if attempts.value == 0 || attempts.value > 100 => {
                self.report(origin.at(
                    attempts,
                    "`maxAttempts` counts every attempt including the first: use 1 to 100",
                ));
                3
            }
            Some(attempts) => attempts.value,
            None => 3,
        };
        let backoff_initial = self.duration(
            origin,
            &spec.backoff.initial,
            Duration::from_millis(200),
            "backoff.initial",
        );
        let backoff_max = self.duration(
            origin,
            &spec.backoff.max,
            Duration::from_secs(5),
            "backoff.max",
        );
        if backoff_initial > backoff_max
            && let Some(max) = &spec.backoff.max
        {
            self.report(origin.at(max, "`backoff.max` must be at least `backoff.initial`"));
        }
        RecoveryConfig {
            max_attempts,
            backoff_initial,
            backoff_max,
            retry_on: spec.retry_on.clone().unwrap_or_else(|| {
                vec![
                    RetryKind::Timeout,
                    RetryKind::Upstream5xx,
                    RetryKind::RateLimited,
                    RetryKind::Connection,
                ]
            }),
            resume_on_start: spec.resume_on_start.unwrap_or(true),
        }
    }

    /// `budgets` and `rateLimits`: names, limits, windows, what they match, and a price for
    /// every model a cost budget may be charged for.
    fn spend(
        &mut self,
        documents: &Documents,
        inventory: &Inventory,
        agents: &BTreeMap<String, AgentConfig>,
        models: &BTreeMap<String, ModelConfig>,
    ) -> (Vec<BudgetConfig>, Vec<RateLimitConfig>) {
        let Some(doc) = documents.runtimes.first() else {
            return (Vec::new(), Vec::new());
        };
        let origin = &doc.origin;
        let spec = &doc.raw.spec;
        let key_names: BTreeSet<&str> = spec
            .protocols
            .openai
            .keys
            .iter()
            .map(|key| key.name.value.as_str())
            .collect();
        let mut names = BTreeMap::new();
        let mut budgets = Vec::new();
        for budget in &spec.budgets {
            self.register(&mut names, "budget", origin, &budget.name);
            let matcher = self.spend_match(origin, budget.matcher.as_ref(), inventory, &key_names);
            if budget.max_tokens.is_none() && budget.max_cost.is_none() {
                self.report(
                    origin
                        .at(
                            &budget.name,
                            format!("budget `{}` has no limit", budget.name.value),
                        )
                        .with_hint("set `maxTokens`, `maxCost` or both"),
                );
            }
            if let Some(max) = &budget.max_cost
                && !(max.value.is_finite() && max.value >= 0.0)
            {
                self.report(origin.at(max, "`maxCost` must be zero or a positive number"));
            }
            let window = match budget.window.value.as_str() {
                "calendarDay" => BudgetWindow::CalendarDay,
                "calendarMonth" => BudgetWindow::CalendarMonth,
                "total" => BudgetWindow::Total,
                text => match parse_duration(text) {
                    Ok(duration) if !duration.is_zero() && duration <= MAX_DURATION => {
                        BudgetWindow::Rolling(duration)
                    }
                    Ok(_) => {
                        self.report(
                            origin
                                .at(
                                    &budget.window,
                                    "a rolling `window` is more than 0s and at most 30d",
                                )
                                .with_hint("for longer spans use `calendarMonth` or `total`"),
                        );
                        BudgetWindow::Total
                    }
                    Err(_) => {
                        self.report(
                            origin
                                .at(&budget.window, format!("unknown budget window `{text}`"))
                                .with_hint("a duration such as `24h`, `calendarDay`, `calendarMonth` or `total`"),
                        );
                        BudgetWindow::Total
                    }
                },
            };
            if budget.max_cost.is_some() {
                self.priced_models(origin, &budget.name, &matcher, agents, models);
            }
            budgets.push(BudgetConfig {
                name: budget.name.value.clone(),
                scope: budget.scope,
                matcher,
                max_tokens: budget.max_tokens.as_ref().map(|max| max.value),
                max_cost: budget.max_cost.as_ref().map(|max| max.value),
                window,
            });
        }
        let mut names = BTreeMap::new();
        let mut rate_limits = Vec::new();
        for limit in &spec.rate_limits {
            self.register(&mut names, "rate limit", origin, &limit.name);
            let matcher = self.spend_match(origin, limit.matcher.as_ref(), inventory, &key_names);
            for value in [&limit.requests_per_minute, &limit.tokens_per_minute]
                .into_iter()
                .flatten()
            {
                if value.value == 0 {
                    self.report(origin.at(value, "a rate must be at least 1 per minute"));
                }
            }
            if limit.requests_per_minute.is_none() && limit.tokens_per_minute.is_none() {
                self.report(
                    origin
                        .at(
                            &limit.name,
                            format!("rate limit `{}` has no rate", limit.name.value),
                        )
                        .with_hint("set `requestsPerMinute`, `tokensPerMinute` or both"),
                );
            }
            rate_limits.push(RateLimitConfig {
                name: limit.name.value.clone(),
                scope: limit.scope,
                matcher,
                requests_per_minute: limit.requests_per_minute.as_ref().map(|v| v.value),
                tokens_per_minute: limit.tokens_per_minute.as_ref().map(|v| v.value),
            });
        }
        (budgets, rate_limits)
    }

    fn spend_match(
        &mut self,
        origin: &Origin,
        spec: Option<&raw::SpendMatchSpec>,
        inventory: &Inventory,
        key_names: &BTreeSet<&str>,
    ) -> SpendMatch {
        let Some(spec) = spec else {
            return SpendMatch::default();
        };
        for agent in &spec.agents {
            self.reference(origin, agent, &inventory.agents, "agent", "Agent");
        }
        for key in &spec.keys {
            if !key_names.contains(key.value.as_str()) && !is_key_fingerprint(&key.value) {
                self.report(
                    origin
                        .at(key, format!("unknown key identity `{}`", key.value))
                        .with_hint("name a key of `protocols.openai.keys`, or an unnamed key's identity `key-` and 12 hex digits"),
                );
            }
        }
        SpendMatch {
            keys: spec.keys.iter().map(|k| k.value.clone()).collect(),
            agents: spec.agents.iter().map(|a| a.value.clone()).collect(),
            labels: spec.labels.clone(),
        }
    }

    /// A cost budget needs a price for every model the agents it matches may call.
    fn priced_models(
        &mut self,
        origin: &Origin,
        budget: &Located<String>,
        matcher: &SpendMatch,
        agents: &BTreeMap<String, AgentConfig>,
        models: &BTreeMap<String, ModelConfig>,
    ) {
        let mut unpriced = BTreeSet::new();
        for agent in agents.values() {
            if !matcher.agents.is_empty() && !matcher.agents.contains(&agent.name) {
                continue;
            }
            let Some(model) = agent.model.as_deref().and_then(|id| models.get(id)) else {
                continue;
            };
            for id in std::iter::once(&model.id).chain(&model.fallbacks) {
                if models.get(id).is_some_and(|m| m.pricing.is_none()) {
                    unpriced.insert(id.clone());
                }
            }
        }
        for model in unpriced {
            self.report(
                origin
                    .at(
                        budget,
                        format!(
                            "budget `{}` limits cost, but model `{model}` has no `pricing`",
                            budget.value
                        ),
                    )
                    .with_hint(format!(
                        "add `pricing: {{inputPerMTok: ..., outputPerMTok: ...}}` to model `{model}`"
                    )),
            );
        }
    }

    fn agents(
        &mut self,
        documents: &Documents,
        inventory: &Inventory,
        tools: &BTreeMap<String, ToolConfig>,
        models: &BTreeMap<String, ModelConfig>,
        runtime_memory: Option<&MemoryConfig>,
    ) -> BTreeMap<String, AgentConfig> {
        let mut agents = BTreeMap::new();
        for doc in &documents.agents {
            let agent = self.agent(doc, inventory, tools, models, runtime_memory);
            agents.entry(agent.name.clone()).or_insert(agent);
        }
        agents
    }

    fn agent(
        &mut self,
        doc: &Document<raw::AgentSpec>,
        inventory: &Inventory,
        tools: &BTreeMap<String, ToolConfig>,
        models: &BTreeMap<String, ModelConfig>,
        runtime_memory: Option<&MemoryConfig>,
    ) -> AgentConfig {
        let origin = &doc.origin;
        let spec = &doc.raw.spec;
        let name = &doc.raw.metadata.name.value;
        let backend = spec.backend.value;

        // Backend-specific fields: required where the backend needs them, refused where unused.
        let needs = |field: &str| match field {
            "model" => backend == Backend::Openai,
            "script" => backend == Backend::Scripted,
            "endpoint" => backend == Backend::Http,
            _ => false,
        };
        let present = [
            ("model", spec.model.as_ref().map(|m| m.position)),
            ("script", spec.script.as_ref().map(|s| s.position)),
            ("endpoint", spec.endpoint.as_ref().map(|e| e.position)),
        ];
        let backend_name = format!("{backend:?}").to_lowercase();
        for (field, position) in present {
            match (needs(field), position) {
                (true, None) => self.report(origin.at(
                    &spec.backend,
                    format!("agent `{name}` uses backend `{backend_name}`, which needs `{field}`"),
                )),
                (false, Some(position)) => self.report(
                    origin
                        .diagnostic(
                            position,
                            format!("`{field}` is not used by backend `{backend_name}`"),
                        )
                        .with_hint("remove it, or set the backend that uses it"),
                ),
                _ => {}
            }
        }
        if let Some(model) = &spec.model
            && self.reference(origin, model, &inventory.models, "model", "ModelCatalog")
            && let Some(config) = models.get(&model.value)
            && !config.capabilities.tools
            && !spec.tools.is_empty()
            && backend == Backend::Openai
        {
            self.report(origin.at(
                model,
                format!(
                    "agent `{name}` has tools but model `{}` declares `capabilities.tools: false`",
                    model.value
                ),
            ));
        }

        let instructions = match (&spec.instructions, &spec.instructions_file) {
            (Some(_), Some(file)) => {
                self.report(origin.at(file, "set `instructions` or `instructionsFile`, not both"));
                None
            }
            (Some(text), None) => Some(text.value.clone()),
            (None, Some(file)) => self
                .workspace_file(origin, file, "instructionsFile", None)
                .and_then(|path| self.read_small_file(origin, file, &path, "instructionsFile")),
            (None, None) => None,
        };

        let mut agent_tools = Vec::new();
        for tool in &spec.tools {
            if agent_tools.contains(&tool.value) {
                self.report(origin.at(tool, format!("tool `{}` is listed twice", tool.value)));
            } else if self.reference(origin, tool, &inventory.tools, "tool", "ToolCatalog") {
                let writes_memory = tools.get(&tool.value).is_some_and(|config| {
                    matches!(
                        config.implementation,
                        ToolImplementation::Builtin(BuiltinTool::MemoryWrite)
                    )
                });
                if writes_memory && spec.memory.is_none() {
                    self.report(
                        origin
                            .at(
                                tool,
                                format!(
                                    "tool `{}` writes memory, and agent `{name}` has no `memory`",
                                    tool.value
                                ),
                            )
                            .with_hint(
                                "give the agent `memory: { namespace: ... }`, or remove the tool",
                            ),
                    );
                }
                agent_tools.push(tool.value.clone());
            }
        }
        // Self-delegation is reported with the other delegation cycles.
        for subagent in &spec.subagents {
            if &subagent.value != name {
                self.reference(origin, subagent, &inventory.agents, "agent", "Agent");
            }
        }
        let skills = spec
            .skills
            .iter()
            .filter_map(|skill| {
                let path =
                    self.workspace_file(origin, skill, "skills", Some("resources/skills"))?;
                let name = path
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default();
                Some(SkillFile { name, path })
            })
            .collect();
        let max_iterations = match &spec.max_iterations {
            Some(n) if n.value == 0 || n.value > 1_000 => {
                self.report(origin.at(n, "`maxIterations` must be between 1 and 1000"));
                8
            }
            Some(n) => n.value,
            None => 8,
        };
        let timeout = self.duration(origin, &spec.timeout, Duration::from_secs(120), "timeout");
        let retention = spec.retention.as_ref().map(|retention| {
            let window = Some(retention.requests.clone());
            self.duration_up_to(
                origin,
                &window,
                MAX_RETENTION,
                "retention.requests",
                MAX_RETENTION,
            )
        });
        let memory = spec
            .memory
            .as_ref()
            .map(|memory| self.agent_memory(origin, memory, runtime_memory));
        let response_schema = spec.response_schema.as_ref().and_then(|schema| {
            let describes_object =
                schema.get("type").and_then(serde_json::Value::as_str) == Some("object");
            if !describes_object {
                self.report(origin.at(
                    schema,
                    "`responseSchema` must describe an object (`type: object`)",
                ));
                return None;
            }
            match jsonschema::validator_for(&schema.value) {
                Ok(validator) => Some(ResponseSchema {
                    schema: schema.value.clone(),
                    validator: Arc::new(validator),
                }),
                Err(error) => {
                    self.report(origin.at(
                        schema,
                        format!("`responseSchema` is not a valid JSON Schema: {error}"),
                    ));
                    None
                }
            }
        });
        let client_tools = spec.client_tools.as_ref().and_then(|client| {
            if client.enabled && backend != Backend::Openai {
                self.report(
                    origin
                        .at(client, format!("`clientTools` needs backend `openai`; agent `{name}` uses `{backend_name}`"))
                        .with_hint("remove `clientTools`: only a model can call the client's tools"),
                );
            }
            client
                .enabled
                .then(|| client.risk.unwrap_or(crate::workspace::Risk::Medium))
        });
        if let Some(tools) = spec
            .contract
            .as_ref()
            .and_then(|c| c.required_evidence_tools.as_ref())
            && !tools.is_empty()
        {
            self.not_supported(
                origin,
                tools,
                "contract.requiredEvidenceTools",
                "remove it: execution contracts are not checked by this build",
            );
        }
        let script = match &spec.script {
            Some(steps) => self.script(origin, steps, &spec.tools, tools),
            None => Vec::new(),
        };
        let endpoint = spec.endpoint.as_ref().map(|endpoint| EndpointConfig {
            url: self.http_url(origin, &endpoint.url, "endpoint.url"),
            api_key_env: endpoint
                .api_key_env
                .as_ref()
                .map(|env| self.env_var(origin, env, "apiKeyEnv")),
            timeout: self.duration(
                origin,
                &endpoint.timeout,
                Duration::from_secs(120),
                "endpoint.timeout",
            ),
        });
        AgentConfig {
            name: name.clone(),
            labels: doc.raw.metadata.labels.clone(),
            description: spec.description.clone(),
            backend,
            model: spec.model.as_ref().map(|m| m.value.clone()),
            instructions,
            tools: agent_tools,
            subagents: spec.subagents.iter().map(|s| s.value.clone()).collect(),
            skills,
            max_iterations,
            timeout,
            memory,
            required_evidence_tools: Vec::new(),
            backend_config: spec
                .backend_config
                .as_ref()
                .map(|c| c.value.clone())
                .unwrap_or_default(),
            script,
            endpoint,
            retention,
            client_tools,
            response_schema,
        }
    }

    /// Delegation cycles through `subagents` (`a -> b -> a`, and `a -> a`) would delegate
    /// forever: each is reported once, at the `subagents` entry that closes it. A depth-first
    /// walk (iterative, so a long chain cannot overflow the stack) finds one cycle per back
    /// edge; that is every cycle in the common case, and at least one per tangle otherwise.
    fn delegation_cycles(&mut self, documents: &Documents) {
        #[derive(Clone, Copy, PartialEq, Eq)]
        enum Visit {
            OnPath,
            Done,
        }
        // The first document of each name, as everywhere else; duplicates are reported already.
        let mut graph: BTreeMap<&str, (&Origin, &[Located<String>])> = BTreeMap::new();
        for doc in &documents.agents {
            graph
                .entry(doc.raw.metadata.name.value.as_str())
                .or_insert((&doc.origin, &doc.raw.spec.subagents));
        }
        let mut visits: BTreeMap<&str, Visit> = BTreeMap::new();
        let mut reported: BTreeSet<Vec<&str>> = BTreeSet::new();
        for &start in graph.keys() {
            if visits.contains_key(start) {
                continue;
            }
            visits.insert(start, Visit::OnPath);
            // The current path, each agent with the index of its next `subagents` entry.
            let mut path: Vec<(&str, usize)> = vec![(start, 0)];
            while let Some(&(agent, index)) = path.last() {
                let Some(&(origin, subagents)) = graph.get(agent) else {
                    path.pop();
                    continue;
                };
                let Some(entry) = subagents.get(index) else {
                    visits.insert(agent, Visit::Done);
                    path.pop();
                    continue;
                };
                if let Some(top) = path.last_mut() {
                    top.1 += 1;
                }
                let next = entry.value.as_str();
                match visits.get(next) {
                    None if graph.contains_key(next) => {
                        visits.insert(next, Visit::OnPath);
                        path.push((next, 0));
                    }
                    Some(Visit::OnPath) => {
                        let from = path.iter().position(|(a, _)| *a == next).unwrap_or(0);
                        let cycle: Vec<&str> = path[from..].iter().map(|(a, _)| *a).collect();
                        // The same cycle seen from another agent is the same problem.
                        let mut key = cycle.clone();
                        let smallest = (0..key.len()).min_by_key(|&i| key[i]).unwrap_or(0);
                        key.rotate_left(smallest);
                        if reported.insert(key) {
                            let mut names = cycle;
                            names.push(next);
                            self.report(
                                origin
                                    .at(
                                        entry,
                                        format!("delegation cycle: {}", names.join(" -> ")),
                                    )
                                    .with_hint(
                                        "an agent may not delegate, directly or through others, back to itself",
                                    ),
                            );
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// Scripted steps: every tool call must be one of the agent's tools, with arguments its
    /// schema accepts, so a demo script cannot fail for a reason visible at load time.
    fn script(
        &mut self,
        origin: &Origin,
        steps: &Located<Vec<raw::ScriptStep>>,
        agent_tools: &[Located<String>],
        tools: &BTreeMap<String, ToolConfig>,
    ) -> Vec<ScriptStep> {
        if steps.is_empty() {
            self.report(origin.at(steps, "`script` needs at least one step"));
        }
        let mut compiled = Vec::new();
        for step in steps.iter() {
            match step {
                raw::ScriptStep::Reply(text) => compiled.push(ScriptStep::Reply(text.clone())),
                raw::ScriptStep::ToolCall(call) => {
                    if !agent_tools.iter().any(|t| t.value == call.tool.value) {
                        self.report(
                            origin
                                .at(&call.tool, format!("script calls tool `{}`, which is not in this agent's `tools`", call.tool.value))
                                .with_hint("add it to `tools`: scripted calls pass the same gateway as a model's"),
                        );
                    } else if let Some(tool) = tools.get(&call.tool.value) {
                        let arguments = serde_json::Value::Object(call.arguments.clone());
                        if let Some(error) = tool.input_validator.iter_errors(&arguments).next() {
                            self.report(origin.at(&call.tool, format!("script arguments for `{}` do not match its inputSchema: {error}", call.tool.value)));
                        }
                    }
                    compiled.push(ScriptStep::ToolCall {
                        tool: call.tool.value.clone(),
                        arguments: call.arguments.clone(),
                    });
                }
            }
        }
        compiled
    }

    fn workflows(
        &mut self,
        documents: &Documents,
        inventory: &Inventory,
        tools: &BTreeMap<String, ToolConfig>,
    ) -> BTreeMap<String, WorkflowConfig> {
        let mut workflows = BTreeMap::new();
        for doc in &documents.workflows {
            let origin = &doc.origin;
            let spec = &doc.raw.spec;
            let mut node_names = BTreeMap::new();
            let mut nodes = Vec::new();
            for node in &spec.nodes {
                self.register(&mut node_names, "workflow node", origin, &node.id);
                if let Some(compiled) = self.workflow_node(origin, node, inventory, tools) {
                    nodes.push(compiled);
                }
            }
            if spec.nodes.is_empty() {
                self.report(
                    origin.at(&doc.raw.metadata.name, "a workflow needs at least one node"),
                );
            }
            self.reference(origin, &spec.entry, &node_names, "workflow node", "");
            let mut edges = Vec::new();
            for edge in &spec.edges {
                let from_known =
                    self.reference(origin, &edge.from, &node_names, "workflow node", "");
                self.reference(origin, &edge.to, &node_names, "workflow node", "");
                let from_tool = spec
                    .nodes
                    .iter()
                    .find(|n| n.id.value == edge.from.value)
                    .is_some_and(|n| n.tool.is_some());
                let when = edge.when.as_ref().and_then(|when| {
                    match (when.status, &when.decision, &when.output) {
                        (Some(status), None, None) => Some(EdgeCondition::Status(status)),
                        (None, Some(decision), None) => {
                            if from_known && !from_tool {
                                self.report(origin.at(
                                    decision,
                                    format!("`decision` conditions are for tool nodes; `{}` runs an agent", edge.from.value),
                                ).with_hint("branch on `status` after an agent node"));
                            }
                            Some(EdgeCondition::Decision(decision.value))
                        }
                        (None, None, Some(output)) => {
                            let agent = spec
                                .nodes
                                .iter()
                                .find(|n| n.id.value == edge.from.value)
                                .and_then(|n| n.agent.as_ref());
                            let structured = agent.and_then(|a| {
                                documents.agents.iter().find(|d| d.raw.metadata.name.value == a.value)
                            }).is_some_and(|d| d.raw.spec.response_schema.is_some());
                            if from_known && !structured {
                                self.report(origin.at(
                                    output,
                                    format!("`output` conditions need a structured output: `{}` must run an agent with a `responseSchema`", edge.from.value),
                                ).with_hint("give the agent `responseSchema`, or branch on `status`"));
                            }
                            if !output.value.pointer.is_empty() && !output.value.pointer.starts_with('/') {
                                self.report(origin.at(output, format!("`{}` is not a JSON pointer (it starts with `/`)", output.value.pointer)));
                            }
                            Some(EdgeCondition::Output(output.value.clone()))
                        }
                        _ => {
                            self.report(origin.at(
                                &edge.from,
                                "an edge's `when` takes exactly one of `status`, `decision` and `output`",
                            ));
                            None
                        }
                    }
                });
                edges.push(WorkflowEdge {
                    from: edge.from.value.clone(),
                    to: edge.to.value.clone(),
                    when,
                });
            }
            self.workflow_graph(origin, spec);
            let max_steps = match &spec.max_steps {
                Some(n) if n.value == 0 || n.value > MAX_WORKFLOW_STEPS => {
                    self.report(
                        origin.at(n, format!("`maxSteps` must be 1 to {MAX_WORKFLOW_STEPS}")),
                    );
                    DEFAULT_WORKFLOW_STEPS
                }
                Some(n) => n.value,
                None => DEFAULT_WORKFLOW_STEPS,
            };
            let name = doc.raw.metadata.name.value.clone();
            if inventory.agents.contains_key(&name) && spec.expose_as_model {
                self.report(origin.at(
                    &doc.raw.metadata.name,
                    format!("workflow `{name}` is exposed as a model, and an agent has the same name"),
                ).with_hint("rename one of them: /v1 models are agents and exposed workflows"));
            }
            workflows.entry(name.clone()).or_insert(WorkflowConfig {
                name,
                description: spec.description.clone(),
                entry: spec.entry.value.clone(),
                nodes,
                edges,
                max_steps,
                expose_as_model: spec.expose_as_model,
            });
        }
        workflows
    }

    /// One node: exactly one of `agent` and `tool`, `input` only on agent nodes, `arguments`
    /// only on tool nodes and valid against the tool's schema.
    fn workflow_node(
        &mut self,
        origin: &Origin,
        node: &raw::WorkflowNodeSpec,
        inventory: &Inventory,
        tools: &BTreeMap<String, ToolConfig>,
    ) -> Option<WorkflowNode> {
        let target = match (&node.agent, &node.tool) {
            (Some(agent), None) => {
                self.reference(origin, agent, &inventory.agents, "agent", "Agent");
                if let Some(arguments) = &node.arguments {
                    self.report(origin.at(arguments, "`arguments` are for tool nodes"));
                }
                WorkflowTarget::Agent(agent.value.clone())
            }
            (None, Some(tool)) => {
                self.reference(origin, tool, &inventory.tools, "tool", "ToolCatalog");
                if let Some(input) = &node.input {
                    self.report(origin.at(input, "`input` is for agent nodes"));
                }
                // Without `arguments`, the previous agent node's structured output is checked
                // by the gateway when the node runs.
                if let (Some(config), Some(arguments)) = (tools.get(&tool.value), &node.arguments) {
                    let arguments = serde_json::Value::Object(arguments.value.clone());
                    if let Some(error) = config.input_validator.iter_errors(&arguments).next() {
                        self.report(origin.diagnostic(
                            node.arguments.as_ref().map_or(tool.position, |a| a.position),
                            format!("node `{}`: arguments for `{}` do not match its inputSchema: {error}", node.id.value, tool.value),
                        ));
                    }
                }
                WorkflowTarget::Tool(tool.value.clone())
            }
            _ => {
                self.report(origin.at(
                    &node.id,
                    format!(
                        "workflow node `{}` needs exactly one of `agent` or `tool`",
                        node.id.value
                    ),
                ));
                return None;
            }
        };
        Some(WorkflowNode {
            id: node.id.value.clone(),
            target,
            input: node.input.as_ref().map(|i| i.value).unwrap_or_default(),
            arguments: node
                .arguments
                .as_ref()
                .map(|a| serde_json::Value::Object(a.value.clone())),
        })
    }

    /// Every node must be reachable from `entry`; a cycle needs `maxSteps`.
    fn workflow_graph(&mut self, origin: &Origin, spec: &raw::WorkflowSpec) {
        // An unknown entry is reported already; nothing is reachable from it.
        if !spec.nodes.iter().any(|n| n.id.value == spec.entry.value) {
            return;
        }
        let mut reached = std::collections::BTreeSet::new();
        let mut frontier = vec![spec.entry.value.as_str()];
        while let Some(node) = frontier.pop() {
            if reached.insert(node) {
                frontier.extend(
                    spec.edges
                        .iter()
                        .filter(|e| e.from.value == node)
                        .map(|e| e.to.value.as_str()),
                );
            }
        }
        for node in &spec.nodes {
            if !reached.contains(node.id.value.as_str()) {
                self.report(
                    origin
                        .at(
                            &node.id,
                            format!(
                                "workflow node `{}` cannot be reached from `entry`",
                                node.id.value
                            ),
                        )
                        .with_hint("add an edge to it, or remove it"),
                );
            }
        }
        if spec.max_steps.is_some() {
            return;
        }
        // A cycle: an edge back to a node from which its source is reachable.
        let reaches = |from: &str, to: &str| {
            let mut seen = std::collections::BTreeSet::new();
            let mut frontier = vec![from];
            while let Some(node) = frontier.pop() {
                if node == to {
                    return true;
                }
                if seen.insert(node) {
                    frontier.extend(
                        spec.edges
                            .iter()
                            .filter(|e| e.from.value == node)
                            .map(|e| e.to.value.as_str()),
                    );
                }
            }
            false
        };
        if let Some(back) = spec
            .edges
            .iter()
            .find(|e| reaches(&e.to.value, &e.from.value))
        {
            self.report(
                origin
                    .at(
                        &back.to,
                        format!(
                            "the workflow loops through `{}` and has no `maxSteps`",
                            back.to.value
                        ),
                    )
                    .with_hint("set `maxSteps` to bound how many nodes one request may run"),
            );
        }
    }
}

/// `maxSteps`: default and largest.
const DEFAULT_WORKFLOW_STEPS: u32 = 100;
const MAX_WORKFLOW_STEPS: u32 = 1_000;

/// Tool ids `agents.<name>` are the gateway's delegation tools, one per agent.
const DELEGATION_PREFIX: &str = "agents.";
/// The policy id of a client tool is this prefix and the client's name for it.
pub const CLIENT_TOOL_PREFIX: &str = "client.";
/// `memory.write.maxContentBytes`: default and largest.
const DEFAULT_MEMORY_CONTENT_BYTES: u64 = 4 << 10;
const MAX_MEMORY_CONTENT_BYTES: u64 = 64 << 10;
/// `memory.maxRecall`: default and largest.
const DEFAULT_RECALL: u32 = 5;
const MAX_RECALL: u32 = 50;

/// Largest compiled size of one `redact.patterns` entry.
const REDACT_PATTERN_SIZE_LIMIT: usize = 1 << 20;

/// `*` matches any run of characters; everything else matches itself.
pub fn glob_matches(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let Some(first) = parts.next() else {
        return pattern == text;
    };
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(index) => rest = &rest[index + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(unix)]
fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o111 != 0)
}

#[cfg(not(unix))]
fn is_executable(path: &Path) -> bool {
    path.is_file()
}

/// Whether `identity` is how an unnamed key is known: `key-` and 12 hex digits.
fn is_key_fingerprint(identity: &str) -> bool {
    identity
        .strip_prefix("key-")
        .is_some_and(|hex| hex.len() == 12 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::glob_matches;

    #[test]
    fn globs() {
        assert!(glob_matches("files.*", "files.delete"));
        assert!(glob_matches("*", "anything"));
        assert!(glob_matches("*.delete", "files.delete"));
        assert!(glob_matches("a*b*c", "aXbYc"));
        assert!(glob_matches("exact", "exact"));
        assert!(!glob_matches("files.*", "fs.read"));
        assert!(!glob_matches("a*bc", "abc_"));
        assert!(!glob_matches("ab*ba", "aba"));
    }
}
