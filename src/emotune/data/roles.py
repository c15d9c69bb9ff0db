"""Role names in conversation rows: which tag means which side (system, user, assistant), read up to capitals, and
why a turn's role is none of them."""

from __future__ import annotations

from emotune.core.config.sft import SftTags

OPENAI_TAGS = SftTags(role_tag="role", content_tag="content", user_tag="user", assistant_tag="assistant",
                      observation_tag="tool", function_tag="function_call", system_tag="system")

SHAREGPT_TAGS = SftTags()
SHAREGPT_ALIASES = (("user", "user"), ("assistant", "assistant"), ("tool", "user"))
"""Role names read beside ShareGPT's default tags (`human`, `gpt`, `observation`), as Axolotl's and Unsloth's ShareGPT
readers map them: files written with OpenAI's names inside `conversations` are common. data.tags other than the defaults
read only the names they give."""


def role_sides(tags: SftTags) -> dict[str, str]:
    """Each role tag of `tags` -> the side it is trained on: `system`, `user` (tool results too) or `assistant` (tool
    calls too)."""
    sides = {tags.system_tag: "system", tags.user_tag: "user", tags.observation_tag: "user",
             tags.assistant_tag: "assistant", tags.function_tag: "assistant"}
    if tags is OPENAI_TAGS:  # OpenAI's newer name for the system role, and its older one for a tool's result
        sides.update(developer="system", function="user")
    elif tags == SHAREGPT_TAGS:  # ShareGPT's default tags: also the role names Axolotl and Unsloth read in ShareGPT files
        sides = {**dict(SHAREGPT_ALIASES), **sides}
    return sides


def side_of(turn: dict, tags: SftTags) -> str | None:
    """The side (`system`, `user`, `assistant`) a turn's role is read as, its capitals aside; None for no known role."""
    side = role_sides(tags)
    return side.get(role_reader(side, tags.role_tag)(turn))


def role_reader(side: dict[str, str], role_tag: str):
    """A turn -> its role, written as the tag it names up to capitals and surrounding spaces (`Human`, `GPT`, `User `,
    as hand-made and converted files write them; an exact name wins); a role no tag names is returned as it is, for the
    error."""
    tags = {name.strip().casefold(): name for name in side}

    def role_of(turn: dict) -> object:
        role = turn.get(role_tag)
        return tags.get(role.strip().casefold(), role) if isinstance(role, str) and role not in side else role
    return role_of


def unknown_role(turn: dict, tags: SftTags) -> str:
    """Why a turn's role is none of the tags: the key is missing, or its value is another one (shown, so that rows
    with the same role are reported together)."""
    named = (f"data.tags (user_tag {tags.user_tag!r}, assistant_tag {tags.assistant_tag!r}, observation_tag "
             f"{tags.observation_tag!r}, function_tag {tags.function_tag!r}, system_tag {tags.system_tag!r})")
    if tags.role_tag not in turn:
        keys = ", ".join(f"`{k}`" for k in list(turn)[:6]) or "none"
        return (f"a turn has no `{tags.role_tag}` key (data.tags.role_tag; its keys: {keys}); set data.tags.role_tag "
                "and data.tags.content_tag to the keys of the role and the text (in dataset_info.json: the entry's "
                "\"tags\"), e.g. role and content for OpenAI-style turns")
    role = str(turn[tags.role_tag])[:40]
    if tags is OPENAI_TAGS:
        return (f"a turn has the role {role!r}, which is not one of OpenAI's (system, developer, user, assistant, tool, "
                "function); for other role names set data.format=sharegpt and data.tags to them")
    hint = (" For OpenAI-style role names set data.tags.user_tag=user and data.tags.assistant_tag=assistant (in "
            "dataset_info.json: the entry's \"tags\")") if role in ("user", "assistant") else ""
    return f"a turn has the role {role!r}, which is none of {named}.{hint}"
